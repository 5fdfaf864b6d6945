"""The client's chunk writer on uvicorn's own request/response cycle: it writes exactly the
bytes uvicorn's `send` writes for a chunk of a chunked response, and refuses whenever
`send` would wait (the client's buffer is full), drop the bytes (client gone, response
complete) or frame them otherwise (not started, a sized body, HEAD)."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Coroutine
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
from uvicorn.server import ServerState

from specrouter.edge.guard import GuardedHttpToolsProtocol
from specrouter.edge.writer import CycleChunkWriter
from specrouter.proxy.response import CHUNK_WRITER

STREAM_HEAD = [(b"content-type", b"text/event-stream")]


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def cycle(method: str = "POST") -> tuple[RequestResponseCycle, Transport]:
    transport = Transport()
    log = logging.getLogger("test")
    scope: Any = {"type": "http", "method": method, "path": "/v1/chat/completions",
                  "headers": []}
    made = RequestResponseCycle(scope, transport, FlowControl(transport), log, log, False, [],
                                asyncio.Event(), False, True, lambda: None)
    return made, transport


async def start(c: RequestResponseCycle, headers: list[tuple[bytes, bytes]]) -> None:
    await c.send({"type": "http.response.start", "status": 200, "headers": headers})


def test_the_writer_writes_what_send_writes() -> None:
    async def scenario() -> None:
        by_send, sent = cycle()
        by_writer, written = cycle()
        for c in (by_send, by_writer):
            await start(c, STREAM_HEAD)
        for data in (b"data: {}\n\n", b"data: [DONE]\n\n"):
            await by_send.send({"type": "http.response.body", "body": data, "more_body": True})
            assert CycleChunkWriter(by_writer)(data)
        assert bytes(written.written) == bytes(sent.written)

    asyncio.run(scenario())


@pytest.mark.parametrize("state", ["not started", "sized body", "HEAD", "client gone",
                                   "closing", "buffer full", "complete"])
def test_the_writer_refuses_where_send_would_not_write_a_chunk(state: str) -> None:
    async def scenario() -> None:
        c, transport = cycle("HEAD" if state == "HEAD" else "POST")
        if state == "sized body":
            await start(c, [(b"content-length", b"5")])
        elif state != "not started":
            await start(c, STREAM_HEAD)
        if state == "client gone":
            c.disconnected = True
        elif state == "closing":
            transport.closing = True
        elif state == "buffer full":
            c.flow.pause_writing()
        elif state == "complete":
            await c.send({"type": "http.response.body", "body": b"", "more_body": False})
        before = bytes(transport.written)
        assert not CycleChunkWriter(c)(b"data: {}\n\n")
        assert bytes(transport.written) == before

    asyncio.run(scenario())


def run_without_collector(scenario: Coroutine[Any, Any, None]) -> None:
    """Run `scenario` with the garbage collector off: what it frees, reference counts
    freed."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        asyncio.run(scenario)
    finally:
        if enabled:
            gc.enable()


def test_a_cycle_whose_scope_holds_its_writer_is_freed_without_the_collector() -> None:
    """The guard puts the writer in its cycle's scope: the writer must not hold the cycle,
    or every request's cycle, scope and event would wait for a garbage collection."""
    async def scenario() -> None:
        c, _ = cycle()
        writer = CycleChunkWriter(c)
        c.scope["extensions"] = {CHUNK_WRITER: writer}
        gone = weakref.ref(c)
        del c
        assert gone() is None  # freed by reference count alone (the collector is off)
        assert not writer(b"data: {}\n\n")  # a writer whose cycle is gone refuses

    run_without_collector(scenario())


class _Socket(Transport):
    """A client connection's transport that keeps what the server wrote."""

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
           b"content-length: 2\r\n\r\n{}")


def test_a_finished_request_on_the_guard_is_freed_without_the_collector() -> None:
    """Whatever the guard's protocol puts in a request's scope (the chunk writer) must not
    keep that request's cycle alive: a request that finished is freed by reference count
    once the connection's next request replaced it."""
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEAD})
        assert scope["extensions"][CHUNK_WRITER](b"data: {}\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def scenario() -> None:
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = GuardedHttpToolsProtocol(config=config, server_state=ServerState(),
                                            app_state={})
        protocol.connection_made(_Socket())
        protocol.data_received(REQUEST)
        first = weakref.ref(protocol.cycle)
        await asyncio.gather(*protocol.tasks)
        protocol.data_received(REQUEST)  # the next request replaces the first's cycle
        await asyncio.gather(*protocol.tasks)
        assert first() is None
        protocol.connection_lost(None)

    run_without_collector(scenario())
