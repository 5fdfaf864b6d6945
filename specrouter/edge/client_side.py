"""The client's side of a request on the callback path (`proxy.fastpath.ClientSide`) on
uvicorn's httptools protocol: one request/response cycle whose app task was not started.

The response goes out in the bytes uvicorn's own `send` writes (its status line, its
default headers, `connection: close` when the connection is not kept, chunked framing)
and with its access-log line,
and the cycle's state follows as `send` leaves it: a request handed to the coroutine path
mid-stream goes on through `send`, and uvicorn's keep-alive, pipelining and shutdown
see an ordinary cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from starlette.types import Receive, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from specrouter.proxy.forward import RESUME, Resume
from specrouter.proxy.request import BODY_HELD
from specrouter.proxy.upstream import RawHeaders, RequestBody

_LAST_CHUNK = b"0\r\n\r\n"


class CycleClient:
    """`ClientSide` for one cycle; `start_task` starts the cycle's ASGI app task and
    `on_finished` tells the protocol the callback path is done with the request."""

    __slots__ = ("_cycle", "_on_finished", "_start_task", "body", "held", "receive", "scope",
                 "send")

    def __init__(self, cycle: RequestResponseCycle, start_task: Callable[[], None],
                 on_finished: Callable[[], None], held: int = 0) -> None:
        self._cycle = cycle
        self._start_task = start_task
        self._on_finished = on_finished
        self.scope: Any = cycle.scope
        # the app reads the same buffer if the request falls back
        self.body: RequestBody = cycle.body
        self.send = cast(Send, cycle.send)
        self.receive = cast(Receive, cycle.receive)
        self.held = held  # the body's budget, reserved while the body arrived

    def respond(self, status: int, headers: RawHeaders, chunked: bool, body: bytes = b"",
                end: bool = False) -> None:
        cycle = self._cycle
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        if cycle.access_log:
            scope = self.scope
            cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope),
                                     scope["method"], get_path_with_query_string(scope),
                                     scope["http_version"], status)
        content = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            content.append(b"connection: close\r\n")
        cycle.chunked_encoding = chunked
        if chunked:
            content.append(b"transfer-encoding: chunked\r\n\r\n")
            if body:
                content.append(b"%x\r\n%b\r\n" % (len(body), body))
            if end:
                content.append(_LAST_CHUNK)
        else:
            content += (b"\r\n", body)
        self._write(b"".join(content))
        if end:
            self._complete()

    def write_chunk(self, data: bytes) -> bool:
        cycle = self._cycle
        if data and not cycle.disconnected and not cycle.transport.is_closing():
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    def end_response(self, last: bytes) -> None:
        if self._cycle.response_complete:
            return
        self._write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else _LAST_CHUNK)
        self._complete()

    def _complete(self) -> None:
        cycle = self._cycle
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    def abort(self) -> None:
        self._cycle.transport.close()

    def fall_back(self, resume: Resume | None) -> None:
        if resume is not None:
            self.scope.setdefault("extensions", {})[RESUME] = resume
        if self.held:
            self.scope.setdefault("extensions", {})[BODY_HELD] = self.held
            self.held = 0  # the app's now
        self._on_finished()
        self._start_task()

    def finished(self) -> None:
        self._on_finished()

    def _write(self, data: bytes) -> None:
        cycle = self._cycle
        if not cycle.disconnected and not cycle.transport.is_closing():
            cycle.transport.write(data)
