"""The cycle that holds a response's head until its first body part: the client gets the
bytes uvicorn's own cycle writes, in one write for the head and first part where uvicorn
writes two; an app that fails after its head has the connection closed as before."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
from uvicorn.server import ServerState

from specrouter.edge.cycle import CoalescedHeadCycle
from specrouter.edge.guard import GuardedHttpToolsProtocol
from tests.edge.test_writer import REQUEST, STREAM_HEAD, Transport, _Socket

SIZED_HEAD = [(b"content-type", b"application/json"), (b"content-length", b"2")]


class CountingTransport(Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes += 1
        super().write(data)

    def close(self) -> None:
        self.closed = True


def make(kind: type[RequestResponseCycle]) -> tuple[RequestResponseCycle, CountingTransport]:
    transport = CountingTransport()
    log = logging.getLogger("test")
    scope: Any = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                  "headers": []}
    made = kind(scope, transport, FlowControl(transport), log, log, False, [],
                asyncio.Event(), False, True, lambda: None)
    return made, transport


async def answer(c: RequestResponseCycle, head: list[tuple[bytes, bytes]],
                 parts: list[bytes]) -> None:
    await c.send({"type": "http.response.start", "status": 200, "headers": head})
    for i, part in enumerate(parts):
        await c.send({"type": "http.response.body", "body": part,
                      "more_body": i < len(parts) - 1})


def test_a_stream_gets_uvicorns_bytes_with_its_head_and_first_chunk_in_one_write() -> None:
    async def scenario() -> None:
        parts = [b"data: {}\n\n", b"data: [DONE]\n\n", b""]
        plain, by_uvicorn = make(RequestResponseCycle)
        held, coalesced = make(CoalescedHeadCycle)
        await answer(plain, STREAM_HEAD, parts)
        await answer(held, STREAM_HEAD, parts)
        assert bytes(coalesced.written) == bytes(by_uvicorn.written)
        assert (coalesced.writes, by_uvicorn.writes) == (3, 4)

    asyncio.run(scenario())


def test_a_sized_answer_leaves_in_one_write() -> None:
    async def scenario() -> None:
        plain, by_uvicorn = make(RequestResponseCycle)
        held, coalesced = make(CoalescedHeadCycle)
        await answer(plain, SIZED_HEAD, [b"{}"])
        await answer(held, SIZED_HEAD, [b"{}"])
        assert bytes(coalesced.written) == bytes(by_uvicorn.written)
        assert (coalesced.writes, by_uvicorn.writes) == (1, 2)
        assert held.response_complete

    asyncio.run(scenario())


def test_an_app_that_fails_after_its_head_has_the_connection_closed() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": STREAM_HEAD})
        raise RuntimeError("the app failed after its head")

    async def scenario() -> None:
        held, transport = make(CoalescedHeadCycle)
        await held.run_asgi(app)
        assert transport.closed and transport.writes == 0

    logging.getLogger("test").disabled = True
    asyncio.run(scenario())


def test_the_guards_protocol_answers_in_one_write() -> None:
    class Counting(_Socket):
        writes = 0

        def write(self, data: Any) -> None:
            self.writes += 1
            super().write(data)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": SIZED_HEAD})
        await send({"type": "http.response.body", "body": b"{}"})

    async def scenario() -> None:
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = GuardedHttpToolsProtocol(config=config, server_state=ServerState(),
                                            app_state={})
        socket = Counting()
        protocol.connection_made(socket)
        protocol.data_received(REQUEST)
        await asyncio.gather(*protocol.tasks)
        assert bytes(socket.written).startswith(b"HTTP/1.1 200 OK\r\n")
        assert bytes(socket.written).endswith(b"\r\n\r\n{}") and socket.writes == 1
        protocol.connection_lost(None)

    asyncio.run(scenario())
