"""The request-head timer of the router's uvicorn protocol on a keep-alive connection: a
head that arrives in one read costs no timer, a head that trickles in after an answered
request is still cut at `header_timeout_s`. A real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from specrouter.edge.guard import GuardedHttpToolsProtocol, apply_limits
from tests.edge.serving import guarded_server

REQUEST = b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n"
TIMEOUT_S = 0.5


async def ok_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def short_head_timeout() -> Iterator[None]:
    before = GuardedHttpToolsProtocol.max_header_bytes, GuardedHttpToolsProtocol.header_timeout_s
    apply_limits(before[0], TIMEOUT_S)
    yield
    apply_limits(*before)


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return head + await asyncio.wait_for(reader.readexactly(2), 10)


def test_heads_that_arrive_in_one_read_arm_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    armed: list[bool] = []
    arm = GuardedHttpToolsProtocol._arm_head_timer

    def counting(self: GuardedHttpToolsProtocol) -> None:
        armed.append(True)
        arm(self)

    monkeypatch.setattr(GuardedHttpToolsProtocol, "_arm_head_timer", counting)

    async def exchange() -> list[bytes]:
        async with guarded_server(ok_app) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            for _ in range(5):
                writer.write(REQUEST)
                answers.append(await _answer(reader))
            writer.close()
            return answers

    answers = asyncio.run(exchange())
    assert all(a.startswith(b"HTTP/1.1 200 ") and a.endswith(b"ok") for a in answers)
    assert len(armed) == 1  # the connection's opening, none for its five heads


@pytest.mark.usefixtures("short_head_timeout")
def test_a_head_trickled_after_an_answered_request_is_cut() -> None:
    async def exchange() -> tuple[bytes, bytes, float]:
        async with guarded_server(ok_app) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST)
            first = await _answer(reader)
            loop = asyncio.get_running_loop()
            began = loop.time()
            writer.write(b"GET /x HTTP/1.1\r\n")
            refusal = b""

            async def trickle() -> None:
                while True:  # one byte of a header at a time, never finishing
                    await asyncio.sleep(0.05)
                    writer.write(b"x")

            trickling = asyncio.create_task(trickle())
            try:
                refusal = await asyncio.wait_for(reader.read(), 10)
            finally:
                trickling.cancel()
                writer.close()
            return first, refusal, loop.time() - began

    first, refusal, took = asyncio.run(exchange())
    assert first.startswith(b"HTTP/1.1 200 ")
    assert refusal.startswith(b"HTTP/1.1 408 "), refusal[:200]
    assert b"not received within 0.5 s" in refusal
    assert TIMEOUT_S <= took < 5.0
