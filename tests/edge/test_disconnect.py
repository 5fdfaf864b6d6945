"""The client's disconnect watch on the router's uvicorn protocol: a client that leaves
while its request is in progress is reported once, through the callback the app armed,
whatever the size of the body it sent (uvicorn stops reading past 64 KiB of unread body;
the watch reads on, as `receive` would). A real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from specrouter.edge.disconnect import CycleDisconnectWatch
from specrouter.proxy.response import DISCONNECT_WATCH
from tests.edge.serving import guarded_server
from tests.edge.test_writer import cycle


class WatchingApp:
    """Reads the body, arms the watch, and holds the request until the watch fires."""

    def __init__(self) -> None:
        self.armed = asyncio.Event()
        self.left = asyncio.Event()
        self.calls = 0

    def _called(self) -> None:
        self.calls += 1
        self.left.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        watch = scope["extensions"][DISCONNECT_WATCH]
        watch(self._called)
        self.armed.set()
        await self.left.wait()


@pytest.mark.parametrize("body_bytes", [16, 300_000])
def test_a_client_that_leaves_is_reported_once(body_bytes: int) -> None:
    async def scenario() -> None:
        app = WatchingApp()
        async with guarded_server(app) as port:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-length: %d\r\n\r\n" % body_bytes + b"x" * body_bytes)
            await asyncio.wait_for(app.armed.wait(), 5.0)
            writer.close()
            await asyncio.wait_for(app.left.wait(), 5.0)
            assert app.calls == 1

    asyncio.run(scenario())


def test_a_watch_armed_after_the_client_left_calls_back_on_the_next_turn() -> None:
    async def scenario() -> None:
        c, _ = cycle()
        c.disconnected = True
        calls: list[str] = []
        CycleDisconnectWatch(c)(lambda: calls.append("gone"))
        assert calls == []  # never from inside the caller (it may be the task it cancels)
        await asyncio.sleep(0)
        assert calls == ["gone"]

    asyncio.run(scenario())


def test_a_disarmed_watch_stays_quiet() -> None:
    async def scenario() -> None:
        c, _ = cycle()
        calls: list[str] = []
        watch = CycleDisconnectWatch(c)
        watch(lambda: calls.append("gone"))
        watch(None)
        c.disconnected = True
        watch.lost()
        assert calls == []

    asyncio.run(scenario())
