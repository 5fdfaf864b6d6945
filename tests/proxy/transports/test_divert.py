"""A diverted body (`NativeResponse.divert`): chunks go to the writer as they arrive; a
refused chunk, and every later one, come back through `iter_raw` in order until the
consumer arms the writer again; the end of the body still ends `iter_raw`.

A real loopback HTTP server (asyncio) writes the chunked answer one chunk per step, each
step started by the test, so the order of arrivals is the test's."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import Any

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.proxy.transports.httpx import HttpxUpstream
from specrouter.proxy.transports.native import NativeUpstream
from specrouter.proxy.upstream import Upstream, UpstreamResponse
from tests.fixtures.http_server import read_request

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Steps:
    """The server's side: each item of `out` is one write: bytes as one chunk (empty: the
    last chunk), a tuple of bytes as that many chunks in one write, None closes."""

    def __init__(self) -> None:
        self.out: asyncio.Queue[bytes | tuple[bytes, ...] | None] = asyncio.Queue()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)
        while (data := await self.out.get()) is not None:
            if isinstance(data, tuple):
                writer.write(b"".join(chunk(d) if d else b"0\r\n\r\n" for d in data))
            else:
                writer.write(chunk(data) if data else b"0\r\n\r\n")
            await writer.drain()
        writer.close()


class Writer:
    """A client writer that takes chunks until told to refuse; `got` wakes on each."""

    def __init__(self) -> None:
        self.taken: list[bytes] = []
        self.refuse = False
        self.got = asyncio.Event()

    def __call__(self, data: bytes) -> bool:
        self.got.set()
        if self.refuse:
            return False
        self.taken.append(data)
        return True


def _upstream(kind: type[NativeUpstream] | type[HttpxUpstream], port: int) -> Upstream:
    upstream: Upstream = kind(Backend("b", f"http://127.0.0.1:{port}", "eagle", "g"),
                              TimeoutSettings(first_byte=5.0), UpstreamSettings(),
                              LimitSettings())
    return upstream


@contextlib.asynccontextmanager
async def served(kind: type[NativeUpstream] | type[HttpxUpstream]
                 ) -> AsyncIterator[tuple[Steps, UpstreamResponse]]:
    """A streamed POST answered by a loopback `Steps` server, through `kind`; the server
    and the upstream are closed when the block ends."""
    steps = Steps()
    server = await asyncio.start_server(steps.serve, "127.0.0.1", 0)
    upstream = _upstream(kind, server.sockets[0].getsockname()[1])
    try:
        yield steps, await upstream.open("POST", "/v1/chat/completions", [], b"{}",
                                         stream=True)
    finally:
        await upstream.aclose()
        server.close()
        await server.wait_closed()


async def diverted_after_first(steps: Steps, response: UpstreamResponse
                               ) -> tuple[AsyncIterator[bytes], Writer]:
    """The first chunk read through `iter_raw` (it goes out through ASGI), then a writer
    armed for the rest."""
    chunks = response.iter_raw()
    steps.out.put_nowait(b"first")
    assert await anext(chunks) == b"first"
    writer = Writer()
    assert response.divert(writer)
    return chunks, writer


def test_diverted_chunks_skip_iter_raw_and_refused_ones_come_back_in_order() -> None:
    async def scenario() -> None:
        async with served(NativeUpstream) as (steps, response):
            chunks, writer = await diverted_after_first(steps, response)
            for data in (b"a", b"b"):
                writer.got.clear()
                steps.out.put_nowait(data)
                await writer.got.wait()
            assert writer.taken == [b"a", b"b"]  # and nothing woke the consumer for them
            writer.refuse = True
            writer.got.clear()
            steps.out.put_nowait(b"c")
            await writer.got.wait()
            assert await anext(chunks) == b"c"  # the refused chunk comes back
            writer.refuse = False
            writer.got.clear()
            steps.out.put_nowait(b"d")
            assert await anext(chunks) == b"d"  # not re-armed: d follows c through iter_raw
            assert not writer.got.is_set()
            response.divert(writer)  # the consumer sent c and d: armed again
            steps.out.put_nowait(b"e")
            steps.out.put_nowait(b"")
            steps.out.put_nowait(None)
            assert [x async for x in chunks] == []  # the end still ends iter_raw
            assert writer.taken == [b"a", b"b", b"e"]
            await response.aclose()

    asyncio.run(scenario())


def test_the_chunks_of_one_read_reach_the_writer_in_one_call() -> None:
    async def scenario() -> None:
        async with served(NativeUpstream) as (steps, response):
            chunks, writer = await diverted_after_first(steps, response)
            steps.out.put_nowait((b"a", b"b", b"c"))  # one write, read as one
            await writer.got.wait()
            assert writer.taken == [b"abc"]
            writer.refuse = True
            writer.got.clear()
            steps.out.put_nowait((b"d", b"e", b""))  # refused together, then the end
            await writer.got.wait()
            assert [x async for x in chunks] == [b"de"]
            assert writer.taken == [b"abc"]
            await response.aclose()

    asyncio.run(scenario())


def test_the_httpx_transport_declines_to_divert() -> None:
    async def scenario() -> None:
        async with served(HttpxUpstream) as (steps, response):
            writer = Writer()
            assert not response.divert(writer)
            for data in (b"x", b"", None):
                steps.out.put_nowait(data)
            assert b"".join([c async for c in response.iter_raw()]) == b"x"
            assert writer.taken == []
            await response.aclose()

    asyncio.run(scenario())


class KeepAliveServer:
    """Answers every request on a connection with its head at once, then, once `go` is
    set, one chunk and the end, keeping the connection open; counts the connections it
    accepted."""

    def __init__(self) -> None:
        self.connections = 0
        self.go = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                writer.write(HEAD)
                await self.go.wait()
                self.go.clear()
                writer.write(chunk(b"a") + b"0\r\n\r\n")
                await writer.drain()


def test_a_pooled_connection_keeps_nothing_of_its_last_exchange() -> None:
    async def scenario() -> None:
        keep_alive = KeepAliveServer()
        server = await asyncio.start_server(keep_alive.serve, "127.0.0.1", 0)
        upstream = _upstream(NativeUpstream, server.sockets[0].getsockname()[1])
        try:
            for _ in range(2):
                response = await upstream.open("POST", "/v1/chat/completions", [], b"{}",
                                               stream=True)
                writer = Writer()
                response.divert(writer)
                keep_alive.go.set()  # the body comes to the armed writer
                assert [c async for c in response.iter_raw()] == []
                assert writer.taken == [b"a"]
                await response.aclose()  # the connection goes back to the pool
                gone = weakref.ref(writer)
                del writer
                assert gone() is None  # the idle connection does not hold the writer
            assert keep_alive.connections == 1  # the second request reused the first's
        finally:
            await upstream.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


class _Pausing:
    """An exchange listener that stops reading as the answer ends, as the callback path
    does when writing the last bytes fills the client's buffer."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.data: list[bytes] = []
        self.ended = asyncio.Event()

    def on_head(self, status: int, headers: Any) -> None:
        pass

    def on_data(self, data: bytes) -> None:
        self.data.append(data)

    def on_end(self, last: bytes) -> None:
        self.data.append(last)
        self.conn.pause_reading()
        self.ended.set()

    def on_error(self, error: Exception) -> None:
        raise AssertionError(error)


def test_a_connection_whose_reading_was_paused_reads_again_once_back_in_the_pool() -> None:
    """An answer whose end made its consumer stop reading leaves the connection paused;
    the pool must not hand out a connection that reads nothing."""
    async def scenario() -> None:
        keep_alive = KeepAliveServer()
        server = await asyncio.start_server(keep_alive.serve, "127.0.0.1", 0)
        upstream = _upstream(NativeUpstream, server.sockets[0].getsockname()[1])
        assert isinstance(upstream, NativeUpstream)
        try:
            warm = await upstream.open("POST", "/v1/chat/completions", [], b"{}", stream=True)
            keep_alive.go.set()
            assert [c async for c in warm.iter_raw()] == [b"a"]
            await warm.aclose()
            for _ in range(2):
                listener = _Pausing()
                listener.conn = upstream.start("POST", "/v1/chat/completions", [], b"{}",
                                               listener, stream=True)
                assert listener.conn is not None  # the idle connection took it
                keep_alive.go.set()  # the chunk and the end, in one write
                await listener.ended.wait()
                assert b"".join(listener.data) == b"a"
                upstream.finish(listener.conn)
            assert keep_alive.connections == 1
        finally:
            await upstream.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(asyncio.wait_for(scenario(), 10))
