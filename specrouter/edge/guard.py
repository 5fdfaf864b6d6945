"""uvicorn's httptools protocol with the limits it lacks: request-head size and time, and
connections within the descriptor budget (`BudgetedHttpToolsProtocol`).

httptools buffers a header of any size, and a connection that sends its request head one
byte a minute (slowloris), or nothing at all, would hold a file descriptor and a slot of
`limit_concurrency` forever. This protocol answers 431 once a request head (request line
plus headers) passes `max_header_bytes`, and closes a connection whose head is not complete
within `header_timeout_s` of its first byte (or of the connection opening). Bodies and
responses are untouched: a long generation is normal, a long request head never is. Past
`limit_concurrency` the 503, and a request the parser rejects gets its 400, in OpenAI
format, like every router error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from specrouter.edge.body import CycleBodyComplete
from specrouter.edge.client_side import CycleClient
from specrouter.edge.disconnect import CycleDisconnectWatch, mark_disconnected
from specrouter.edge.writer import CycleChunkWriter
from specrouter.errors import RouterError, openai_error_body
from specrouter.proxy.fastpath import FastExchange, FastPath
from specrouter.proxy.request import BODY_COMPLETE
from specrouter.proxy.response import CHUNK_WRITER, DISCONNECT_WATCH
from specrouter.routing.arrivals import GENERATION_PATHS


def _response(status: int, reason: bytes, message: str) -> bytes:
    body = openai_error_body(status, message)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body))) + body


async def _too_many_connections(scope: Any, receive: Any, send: Any) -> None:
    body = openai_error_body(503, "too many connections: retry later", code="overloaded")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _describe_400(msg: str) -> str:
    if msg == "Invalid HTTP request received.":
        return "invalid HTTP request: the request line or a header could not be parsed"
    return msg


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a refused request."""


def _declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _fast_path_of(app: Any) -> FastPath | None:
    """The callback path the app offers (`fast_path`, on it or an app it wraps)."""
    for _ in range(8):
        fast = getattr(app, "fast_path", None)
        if fast is not None:
            return fast  # type: ignore[no-any-return]
        app = getattr(app, "app", None)
        if app is None:
            break
    return None


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """The limits are class attributes: uvicorn instantiates the class once per connection
    and has no way to pass options through. `apply_limits` sets them for this process.

    A generation request is offered to the app's callback path (`proxy.fastpath`) once
    its body is in, instead of starting the app's task; the callback path starts that
    task itself when the request needs it. A body that does not end in the read that
    completed the head is awaited here only when its declared length fits the request
    limit and the process's body budget (reserved until the request is offered) and
    while it arrives within `limits.body_timeout_s` (else 408, as the app answers);
    any other goes to the app, whose read is bounded the same way.
    """

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._raw_head_bytes = 0  # bytes received while the head is incomplete
        self._head_size = 0  # request line plus headers as parsed
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        # the watches of this connection's cycles that went to the app (the one responding
        # and any pipelined behind it), those whose response completed dropped as more come
        self._watches: list[CycleDisconnectWatch] = []
        self._app = self.app  # the app's own (`_too_many_connections` may stand in)
        self._fast = _fast_path_of(self.app)
        self._reading = False  # inside data_received
        self._deferred: RequestResponseCycle | None = None  # waits for its body's end
        self._reserved = 0  # body budget held for a deferred body past its first read
        self._deferral_counted = False  # ... counted in the app's requests in progress
        self._body_timer: asyncio.TimerHandle | None = None
        self._exchange: FastExchange | None = None
        self._exchange_cycle: RequestResponseCycle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # marks the last parsed cycle disconnected
        self._end_deferral()
        watches, self._watches = self._watches, []
        for watch in watches:  # every cycle still responding, pipelined or not
            watch.connection_lost()
        exchange, cycle = self._exchange, self._exchange_cycle
        self._exchange = self._exchange_cycle = None
        if cycle is not None:  # a stream handed over from callbacks goes on by `send`
            mark_disconnected(cycle)
        if exchange is not None:
            exchange.client_lost()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._exchange is not None:
            self._exchange.pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._exchange is not None:
            self._exchange.resume()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        scope = cycle.scope
        if (self._fast is None or app is not self._app or scope["method"] != "POST"
                or scope["path"] not in GENERATION_PATHS):
            super()._start_asgi_task(cycle, app)
        elif not cycle.more_body:
            self._take(cycle)
        elif self._reading:
            self._deferred = cycle  # taken at its end if it comes in this read
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._reserved and self._deferred is self.cycle and self.flow.read_paused:
            self.flow.resume_reading()  # the reserved body is read whole, within its budget

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self._deferred
        if cycle is not None and cycle is self.cycle and not cycle.more_body:
            held, self._reserved = self._reserved, 0  # the request takes the reservation on
            self._end_deferral()
            self._take(cycle, held)

    def _keep_deferring(self, cycle: RequestResponseCycle) -> bool:
        """Whether to wait here for the rest of a deferred body: its declared length fits
        the request limit and the body budget (taken now, until the deferral ends)."""
        if self._reserved:
            return True
        if cycle.waiting_for_100_continue:
            return False  # the client waits for the app's `100 Continue`
        fast = self._fast
        length = _declared_length(cycle.scope["headers"])
        if fast is None or length is None or length > fast.proxy.max_body:
            return False
        try:
            fast.proxy.bodies.take(length)
        except RouterError:
            return False
        self._reserved, self._deferral_counted = length, True
        fast.count_active(1)  # a request in progress, as the app counts one reading its body
        self._body_timer = self.loop.call_later(fast.proxy.body_timeout, self._body_timed_out)
        if self.flow.read_paused:  # uvicorn pauses past 64 KiB of unread body
            self.flow.resume_reading()
        return True

    def _end_deferral(self) -> None:
        """Forget the deferred request (its reservation, its timer)."""
        self._deferred = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._reserved and self._fast is not None:
            self._fast.proxy.bodies.give_back(self._reserved)
        if self._deferral_counted and self._fast is not None:
            self._fast.count_active(-1)
        self._reserved, self._deferral_counted = 0, False

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._deferred is not None and self._fast is not None:
            timeout = self._fast.proxy.body_timeout
            self._end_deferral()
            self._refuse(408, b"Request Timeout",
                         f"request body not received within {timeout:g} s")

    def _take(self, cycle: RequestResponseCycle, held: int = 0) -> None:
        """Offer the request to the callback path, with `held` bytes of its body's budget."""
        assert self._fast is not None
        client = CycleClient(cycle, lambda: self._start_app(cycle),
                             lambda: self._exchange_done(cycle), held)
        exchange = self._fast.take(client)
        if exchange is not None:
            self._exchange, self._exchange_cycle = exchange, cycle

    def _exchange_done(self, cycle: RequestResponseCycle) -> None:
        if self._exchange_cycle is cycle:
            self._exchange = self._exchange_cycle = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._raw_head_bytes += len(data)
        self._reading = True
        try:
            super().data_received(data)
        finally:
            self._reading = False
        cycle = self._deferred
        if cycle is not None and not self._keep_deferring(cycle):
            self._end_deferral()  # its body did not end in this read: the app reads it
            self._start_app(cycle)
        if not self._in_head or self._refused:
            return
        # A head still incomplete after this many bytes is refused without waiting for
        # its end: what httptools buffers stays bounded (the limit plus one read).
        if self._raw_head_bytes > self.max_header_bytes:
            self._refuse_too_large()
        elif self._head_timer is None:  # a head begun in this read and not yet complete
            self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        if self._refused:  # our 431 went out already; the parser error is ours
            return
        self._refused = True
        if not self.transport.is_closing():
            self.transport.write(_response(400, b"Bad Request", _describe_400(msg)))
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        if not self._in_head:  # the next request on a keep-alive connection
            # its head timer is armed only if the read that began the head ends before
            # the head does (`data_received`): most heads arrive in one read
            self._in_head, self._raw_head_bytes = True, 0

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        if self._head_size > self.max_header_bytes:
            self._refuse_too_large()
            raise _HeadRefused  # stops the parser; send_400_response stays quiet
        if not self._over_concurrency():
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope and self._deferred is not cycle:
                self._extend(cycle)
            return
        # uvicorn would answer its own plain-text 503; clients parse OpenAI errors. Its
        # limit check is switched off for this one request, which our app then refuses.
        app, limit = self.app, self.limit_concurrency
        self.app, self.limit_concurrency = _too_many_connections, None
        try:
            self.logger.warning("refusing a request: %d connections open", len(self.connections))
            super().on_headers_complete()
        finally:
            self.app, self.limit_concurrency = app, limit

    def _extend(self, cycle: RequestResponseCycle) -> None:
        """What the app's task may use of the server: it may write its stream's chunks
        past `send` (`edge.writer`), learn of a disconnect without a task waiting in
        `receive` (`edge.disconnect`) and read a body that is in without a timer
        (`edge.body`). A request the callback path serves needs none of it."""
        watch = CycleDisconnectWatch(cycle)
        self._watches = [w for w in self._watches if w.open]
        self._watches.append(watch)
        extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
        extensions[CHUNK_WRITER] = CycleChunkWriter(cycle)
        extensions[DISCONNECT_WATCH] = watch
        extensions[BODY_COMPLETE] = CycleBodyComplete(cycle)

    def _start_app(self, cycle: RequestResponseCycle) -> None:
        """Start the app's task for a request the callback path was offered."""
        self._extend(cycle)
        super()._start_asgi_task(cycle, self._app)

    def _over_concurrency(self) -> bool:
        limit = self.limit_concurrency
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)

    def _refuse_too_large(self) -> None:
        self._refuse(431, b"Request Header Fields Too Large",
                     f"request head exceeds the {self.max_header_bytes} byte limit")

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(408, b"Request Timeout",
                         f"request head not received within {self.header_timeout_s:g} s")

    def _refuse(self, status: int, reason: bytes, message: str) -> None:
        self._cancel_head_timer()
        self._refused = True
        if not self.transport.is_closing():
            self.logger.warning("closing connection: %s", message)
            self.transport.write(_response(status, reason, message))
            self.transport.close()


def apply_limits(max_header_bytes: int, header_timeout_s: float) -> None:
    """Set the limits of every connection this process accepts from now on."""
    GuardedHttpToolsProtocol.max_header_bytes = max_header_bytes
    GuardedHttpToolsProtocol.header_timeout_s = header_timeout_s


#: What uvicorn's `http=` takes: an import string survives the trip to worker processes.
PROTOCOL = "specrouter.edge.guard:BudgetedHttpToolsProtocol"
#: Connections beyond the budget waiting for their request head to be refused.
MAX_PENDING_REFUSALS = 16


def _refusal() -> bytes:
    body = openai_error_body(503, "too many connections: retry later", code="overloaded")
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body


class BudgetedHttpToolsProtocol(GuardedHttpToolsProtocol):
    """Serves fewer than `limit_concurrency` connections at once.

    A connection beyond that is not served: it leaves uvicorn's connection set (so it takes
    no place of a served one) and gets the 503 as soon as its request head starts to arrive
    (answering before the client has written would make its write meet a closed socket),
    or after `refusal_grace_s` if it sends nothing. At most `MAX_PENDING_REFUSALS` wait so;
    beyond that a connection gets the 503 at once. Served connections are then always
    fewer than the limit, so uvicorn's own check never refuses a request on a keep-alive
    connection that was accepted within the budget.
    """

    refusal_grace_s: ClassVar[float] = 0.5
    pending_refusals: ClassVar[int] = 0
    refused_since_warning: ClassVar[int] = 0
    last_warning: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._over_budget = False
        self._refusal_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.limit_concurrency
        over = limit is not None and len(self.connections) >= limit - 1
        super().connection_made(transport)
        if not over:
            return
        self.connections.discard(self)
        self._over_budget = True
        cls = BudgetedHttpToolsProtocol
        cls.pending_refusals += 1
        if cls.pending_refusals > MAX_PENDING_REFUSALS:
            self._refuse_connection()
        else:
            self._refusal_timer = self.loop.call_later(self.refusal_grace_s,
                                                       self._refuse_connection)

    def data_received(self, data: bytes) -> None:
        if self._over_budget:
            self._refuse_connection()
            return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._over_budget:
            self._over_budget = False
            BudgetedHttpToolsProtocol.pending_refusals -= 1
            if self._refusal_timer is not None:
                self._refusal_timer.cancel()
        super().connection_lost(exc)

    def _refuse_connection(self) -> None:
        self._refused = True  # the guard then ignores whatever else arrives
        if self._refusal_timer is not None:
            self._refusal_timer.cancel()
            self._refusal_timer = None
        if not self.transport.is_closing():
            self.transport.write(_refusal())
            self.transport.close()
            self._warn_refused()

    def _warn_refused(self) -> None:
        """One warning per 10 s at most: a flood of connections must not flood the log."""
        cls = BudgetedHttpToolsProtocol
        cls.refused_since_warning += 1
        now = time.monotonic()
        if now - cls.last_warning >= 10.0:
            self.logger.warning("refused %d connection(s) beyond the limit of %s open "
                                "connections (limits.max_connections)",
                                cls.refused_since_warning, self.limit_concurrency)
            cls.refused_since_warning, cls.last_warning = 0, now
