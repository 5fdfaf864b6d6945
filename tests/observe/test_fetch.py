"""The telemetry poller's native GET client over real loopback sockets."""

from __future__ import annotations

import asyncio

from specrouter.backends import Backend
from specrouter.observe.fetch import TelemetryFetcher
from tests.fixtures.procs import free_port


async def _server(handler: object) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_answers_reuse_one_connection_and_send_the_key() -> None:
    async def scenario() -> None:
        connections: list[int] = []
        heads: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(1)
            while head := await reader.readuntil(b"\r\n\r\n"):
                heads.append(head)
                body = b'{"loads": []}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()

        server, url = await _server(handle)
        fetcher = TelemetryFetcher(2.0)
        backend = Backend("e", url, "eagle", "g", "k-1")
        try:
            for _ in range(3):
                answer = await fetcher.get(backend, "/v1/loads")
                assert answer is not None
                assert (answer.status_code, answer.text) == (200, '{"loads": []}')
        finally:
            await fetcher.aclose()
            server.close()
        assert len(connections) == 1 and len(heads) == 3
        assert heads[0].startswith(b"GET /v1/loads HTTP/1.1\r\n")
        assert b"authorization: Bearer k-1\r\n" in heads[0]

    asyncio.run(scenario())


def test_no_answer_is_none() -> None:
    async def scenario() -> None:
        silent = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            silent.set()
            await asyncio.sleep(30)

        server, url = await _server(handle)
        fetcher = TelemetryFetcher(0.3)
        try:
            assert await fetcher.get(Backend("s", url, "eagle", "g"), "/metrics") is None
            assert silent.is_set()
            refused = Backend("r", f"http://127.0.0.1:{free_port()}", "eagle", "g")
            assert await fetcher.get(refused, "/metrics") is None
        finally:
            await fetcher.aclose()
            server.close()

    asyncio.run(scenario())
