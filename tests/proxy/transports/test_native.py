"""The native upstream transport under cancellation: a request whose caller is cancelled
while its connection is being opened must not go on without it.

A real loopback HTTP server (asyncio) answers; the only seam is the event loop's
`create_connection`, wrapped so that the caller is cancelled at the instant the connection
completes: the race Python 3.11's `asyncio.wait_for` loses (it can return the connection and
drop the cancel, and the request would go out with nobody left to read or close it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.proxy.transports.native import NativeUpstream

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _server() -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.read(65536):
            writer.write(ANSWER)
            await writer.drain()
        await reader.read()  # hold the stream open until the client leaves
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def test_a_cancel_as_the_connection_completes_is_not_swallowed() -> None:
    async def scenario() -> None:
        server = await _server()
        port = server.sockets[0].getsockname()[1]
        upstream = NativeUpstream(Backend("b", f"http://127.0.0.1:{port}", "eagle", "g"),
                                  TimeoutSettings(), UpstreamSettings(), LimitSettings())
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        caller: asyncio.Task[Any] | None = None

        async def connect_then_cancel(*args: Any, **kwargs: Any) -> Any:
            result = await real(*args, **kwargs)
            assert caller is not None
            caller.cancel()  # the caller leaves just as the connection is made
            return result

        loop.create_connection = connect_then_cancel  # type: ignore[method-assign]
        try:
            caller = asyncio.ensure_future(
                upstream.open("POST", "/v1/chat/completions", [], b"{}", stream=True))
            with pytest.raises(asyncio.CancelledError):
                await caller
        finally:
            loop.create_connection = real  # type: ignore[method-assign]
            await upstream.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())
