"""The native transport: a small HTTP/1.1 client built for relaying.

asyncio protocols, httptools (llhttp, the parser uvicorn uses) for responses, and a LIFO
list of idle keep-alive connections per backend. Checking a connection out or in is O(1);
per body chunk the cost is one parser callback and one list append. It speaks only what
the router needs: one request per connection at a time, bodies sent whole (a large one in
slices as the socket drains, never copied), responses streamed, interim 1xx answers
skipped. A diverted body (`NativeResponse.divert`) goes from the parser straight to the
client's writer: no task wakes, no future is made, per chunk, and the chunks of one socket
read reach the writer together, as one write to the client. A response head is
bounded in bytes and header count (`LimitSettings`).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.observe.local_errors import local_resource_error
from specrouter.proxy.upstream import (
    ChunkWriter,
    Exchange,
    ExchangeListener,
    RawHeaders,
    RequestBody,
    UpstreamError,
    UpstreamLocalError,
    UpstreamOverLimit,
    UpstreamTimeout,
    UpstreamUnreachable,
)

_HIGH_WATER = 1 << 20  # buffered response bytes before reading from the backend pauses
# A body up to this size goes out in the same write as the head; a larger one in slices
# of it, each written once the socket drained, so the transport never copies the body.
_WRITE_SLICE = 256 * 1024


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a response head over the limits."""


class Connection(asyncio.Protocol):
    """One TCP connection to a backend and the state of its current exchange."""

    def __init__(self, connections: ConnectionPool) -> None:
        self._connections = connections
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused
        self._feeding = False  # inside the parser: a listener's end waits for the read's data
        self._held = False  # reading paused by the listener's consumer (`pause_reading`)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: RawHeaders = []
        self._started = False  # an exchange began since the last reset
        self._in_head = False  # ... and its final response head has not arrived
        self._head: asyncio.Future[None] | None = None
        self._listener: ExchangeListener | None = None  # an exchange run on callbacks
        self._chunks: list[bytes] = []
        self._divert: ChunkWriter | None = None
        self._diverting: list[bytes] = []  # diverted body bytes of the read being parsed
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._complete = False
        self._keep_alive = False
        self._close_delimited = True
        self._head_only = False
        self._paused = False
        self._last_activity = 0.0
        self._timeout = 0.0
        self._deadline = float("inf")  # when the whole exchange must have ended
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # raw bytes received before the final head was complete
        self._header_count = 0
        self._interim = False  # parsing a 1xx answer, which is skipped

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._last_activity = self._loop.time()
        in_head = self._in_head
        self._feeding = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._feeding = False
            self._pass_diverted()
            self._fail(UpstreamError(f"bad HTTP response from backend: {exc}"))
            self.close()
            return
        self._feeding = False
        if self._complete and self._listener is not None:
            last, self._diverting = self._diverting, []  # they go with the end
            self._leave_listener().on_end(last[0] if len(last) == 1 else b"".join(last))
            return
        self._pass_diverted()
        if in_head and self._in_head:
            # A head still incomplete after this many bytes is refused without waiting for
            # its end: what httptools buffers stays bounded (the limit plus one read).
            self._head_bytes += len(data)
            if self._head_bytes > self._connections.max_head_bytes:
                self._refuse_head(f"response head exceeds the router's "
                                  f"{self._connections.max_head_bytes} byte limit")

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    def eof_received(self) -> bool:
        return False  # let the transport close; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        self._wake_writer()
        self._connections.forget(self)
        if self._complete or not self._started:
            return
        if self._in_head:
            self._fail(UpstreamUnreachable("backend closed the connection before answering"))
        elif self._close_delimited:
            self._finish()  # a body without length or chunking ends with the connection
        else:
            self._fail(UpstreamError("backend closed the connection mid-response"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_bytes += len(name) + len(value) + 4
        limits = self._connections
        if self._header_count > limits.max_headers:
            self._refuse_head(f"response head has more than the router's limit of "
                              f"{limits.max_headers} headers")
            raise _HeadRefused
        if self._head_bytes > limits.max_head_bytes:
            self._refuse_head(f"response head exceeds the router's "
                              f"{limits.max_head_bytes} byte limit")
            raise _HeadRefused
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or lower == b"transfer-encoding":
            self._close_delimited = False

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints): the final one follows on
            # the same connection. Its headers are dropped; its bytes still count.
            self._interim = True
            self.headers = []
            self._header_count = 0
            return
        self.status = status
        self._in_head = False
        self._keep_alive = self._parser.should_keep_alive()
        if self.status in (204, 304) or 100 <= self.status < 200:
            self._close_delimited = False
        if self._listener is not None:
            self._divert = self._listener.on_data
            self._listener.on_head(status, self.headers)
        elif self._head is not None and not self._head.done():
            self._head.set_result(None)
        if self._head_only:
            # The answer to HEAD has no body whatever its headers say; llhttp cannot be
            # told, so end the exchange here and never reuse the connection.
            self._keep_alive = False
            self._finish()

    def on_body(self, body: bytes) -> None:
        if self._divert is not None:
            if not self._chunks:
                self._diverting.append(body)  # to the writer once the read is parsed
                return
            self._divert = None  # bytes wait ahead: buffered until re-armed
        self._buffer(body)

    def _pass_diverted(self) -> None:
        """Hand the diverted bytes of the read just parsed to the writer in one call; what
        it refuses is buffered, and so is every later byte until the consumer re-arms it.
        Nothing overtakes them: the consumer runs only after the read's callbacks."""
        pending = self._diverting
        if not pending:
            return
        self._diverting = []
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        divert = self._divert
        if divert is not None and divert(data):
            return
        self._divert = None
        self._buffer(data)

    def _buffer(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._finish()

    # the exchange

    async def send_request(
        self, head: bytes, body: RequestBody, timeout: float, head_only: bool = False,
        max_duration: float | None = None,
    ) -> None:
        """Write the request and return when the final response head arrived. `timeout`
        bounds silence; `max_duration`, if set, the whole exchange."""
        self._reset()
        self._head_only = head_only
        self._head = self._loop.create_future()
        if self.closed:
            raise UpstreamUnreachable("backend closed the connection")
        self._begin(timeout, max_duration)
        if not self._write_head(head, body):
            await self._write_slices(body)
        await self._head

    def start(self, head: bytes, body: RequestBody, timeout: float,
              max_duration: float | None, listener: ExchangeListener) -> None:
        """Write the request and report its answer to `listener`
        (`proxy.upstream.ExchangeListener`), with `send_request`'s timeouts. A body past
        one slice goes in its own write, not copied; what the socket does not take at once
        waits in the transport's buffer."""
        self._reset()
        self._listener = listener
        self._begin(timeout, max_duration)
        if not self._write_head(head, body):
            assert self.transport is not None
            self.transport.write(body)

    def _write_head(self, head: bytes, body: RequestBody) -> bool:
        """Write the request's head, and its body with it when it fits one slice (True);
        a larger body is the caller's to write."""
        assert self.transport is not None
        if len(body) <= _WRITE_SLICE:
            self.transport.write(head + body)
            return True
        self.transport.write(head)
        return False

    def _begin(self, timeout: float, max_duration: float | None) -> None:
        self._started = self._in_head = True
        self._timeout = timeout
        self._last_activity = now = self._loop.time()
        if max_duration is not None:
            self._deadline = now + max_duration
        self._timer = self._loop.call_later(min(timeout, self._deadline - now), self._check_idle)

    def _leave_listener(self) -> ExchangeListener:
        listener = self._listener
        assert listener is not None
        self._listener = self._divert = None
        return listener

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed and not self._held:
            self._held = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._held:
            self._held = False
            if self.transport is not None and not self.closed and not self._paused:
                self.transport.resume_reading()

    def detach(self) -> None:
        self._listener = self._divert = None

    async def _write_slices(self, body: RequestBody) -> None:
        with memoryview(body) as view:
            for start in range(0, len(view), _WRITE_SLICE):
                if self.closed or self._error is not None:
                    return  # the exchange failed; awaiting the head raises its error
                assert self.transport is not None
                self.transport.write(view[start:start + _WRITE_SLICE])
                drained = self._drained
                if drained is not None and not drained.done():
                    await drained

    async def iter_body(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                # Chunks that arrived while the consumer was busy go out together: one
                # write to the client instead of several, and nothing waits longer.
                self._divert = None  # nothing overtakes them: the consumer re-arms it
                chunks, self._chunks = self._chunks, []
                self._buffered = 0
                if self._paused and self.transport is not None and not self.closed:
                    self._paused = False
                    self.transport.resume_reading()
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
                continue
            if self._error is not None:
                raise self._error
            if self._complete:
                return
            self._waiter = self._loop.create_future()
            await self._waiter

    def divert(self, write: ChunkWriter) -> None:
        self._divert = write

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self.closed and self._error is None

    def park(self) -> None:
        """Forget the finished exchange before the connection waits in the pool: an idle
        connection holds nothing of its last caller (the writer it diverted to keeps a
        stream's handover record, up to `handover_max_tokens` x 64 bytes), however long
        it waits for the next request; one its last consumer stopped reading (the answer
        ended as the client's buffer filled) reads again."""
        self.resume_reading()
        self._reset()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _finish(self) -> None:
        self._complete = True
        self._cancel_timer()
        self._wake()
        if self._listener is not None and not self._feeding:
            self._leave_listener().on_end(b"")

    def _fail(self, error: UpstreamError) -> None:
        if self._complete or self._error is not None:
            return
        self._error = error
        self._in_head = False
        self._cancel_timer()
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()
        if self._listener is not None:
            self._leave_listener().on_error(error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_writer(self) -> None:
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _refuse_head(self, message: str) -> None:
        self._fail(UpstreamOverLimit(message))
        self.close()

    def _check_idle(self) -> None:
        """One timer per exchange, re-armed lazily: cheaper than resetting it per chunk."""
        now = self._loop.time()
        if now >= self._deadline:
            self._timer = None
            self._fail(UpstreamOverLimit(
                f"the answer took longer than the router's "
                f"{self._connections.max_duration or 0:g} s stream limit"))
            self.close()
            return
        idle = now - self._last_activity
        if idle < self._timeout:
            left = min(self._timeout - idle, self._deadline - now)
            self._timer = self._loop.call_later(left, self._check_idle)
            return
        self._timer = None
        self._fail(UpstreamTimeout(f"no data from backend for {self._timeout:g}s"))
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ConnectionPool:
    """Keep-alive connections to one backend: LIFO idle list and a cap on open ones."""

    def __init__(self, url: str, max_connections: int, max_idle: int, connect_timeout: float,
                 limits: LimitSettings):
        parts = urlsplit(url)
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.secure else 80)
        self.prefix = parts.path.rstrip("/").encode()
        default_port = (self.secure and self.port == 443) or (not self.secure and self.port == 80)
        self.host_header = (parts.netloc.rpartition("@")[2] if not default_port
                            else self.host).encode()
        self._ssl = ssl.create_default_context() if self.secure else None
        self._max_connections = max_connections
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout
        self.max_head_bytes = limits.max_response_head_bytes
        self.max_headers = limits.max_response_headers
        self.max_duration = limits.max_stream_duration_s
        self._idle: list[Connection] = []
        self._open: set[Connection] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take_idle(self) -> Connection | None:
        """An idle keep-alive connection, None if there is none."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def acquire(self) -> tuple[Connection, bool]:
        """A connection (and whether it was reused), opening one if none is idle."""
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn, True
            if len(self._open) + self._connecting < self._max_connections:
                return await self.connect(), False
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(self._connect_timeout):
                    await waiter
            except TimeoutError:
                raise UpstreamUnreachable(
                    f"all {self._max_connections} connections to the backend are busy"
                ) from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can return a connection
            # that completed as its caller was cancelled, swallowing the cancel, and the
            # request would go out with nobody left to read or close it.
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl else None,
                )
        except TimeoutError:
            raise UpstreamUnreachable(
                f"connect to {self.host}:{self.port} timed out after {self._connect_timeout:g}s"
            ) from None
        except OSError as exc:
            if local_resource_error(exc) is not None:
                raise UpstreamLocalError(f"cannot open a connection to {self.host}:{self.port}:"
                                         f" {exc}") from exc
            raise UpstreamUnreachable(f"connect to {self.host}:{self.port} failed: {exc}") from exc
        finally:
            self._connecting -= 1
            self._wake_one()
        self._open.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        if conn.reusable and len(self._idle) < self._max_idle:
            conn.park()
            self._idle.append(conn)
        else:
            conn.close()
        self._wake_one()

    def forget(self, conn: Connection) -> None:
        """The connection is gone (closed by either side)."""
        self._open.discard(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()


class NativeResponse:
    __slots__ = ("_conn", "_connections", "_released", "headers", "status")

    def __init__(self, conn: Connection, connections: ConnectionPool) -> None:
        self._conn = conn
        self._connections = connections
        self._released = False
        self.status = conn.status
        self.headers: RawHeaders = conn.headers

    def iter_raw(self) -> AsyncIterator[bytes]:
        return self._conn.iter_body()

    def divert(self, write: ChunkWriter) -> bool:
        self._conn.divert(write)
        return True

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._connections.release(self._conn)  # closes the connection unless fully read


class NativeUpstream:
    """The default transport: one ConnectionPool to the backend's URL."""

    def __init__(
        self, backend: Backend, timeouts: TimeoutSettings, upstream: UpstreamSettings,
        limits: LimitSettings,
    ) -> None:
        self._connections = ConnectionPool(
            backend.url, upstream.max_connections_per_backend, upstream.max_idle_per_backend,
            timeouts.connect, limits)
        self._stream_timeout = timeouts.first_byte
        self._total_timeout = timeouts.total

    def _request_head(self, method: str, path: str, headers: RawHeaders,
                      body: RequestBody) -> bytes:
        connections = self._connections
        parts = [method.encode(), b" ", connections.prefix, path.encode("latin-1"),
                 b" HTTP/1.1\r\nhost: ", connections.host_header, b"\r\n"]
        for key, value in headers:
            parts += (key, b": ", value, b"\r\n")
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n")
        return b"".join(parts)

    def start(self, method: str, path: str, headers: RawHeaders, body: RequestBody,
              listener: ExchangeListener, *, stream: bool) -> Connection | None:
        if method == "HEAD":
            return None
        conn = self._connections.take_idle()
        if conn is None:
            return None
        timeout = self._stream_timeout if stream else self._total_timeout
        conn.start(self._request_head(method, path, headers, body), body, timeout,
                   self._connections.max_duration if stream else None, listener)
        return conn

    def finish(self, exchange: Exchange) -> None:
        assert isinstance(exchange, Connection)
        self._connections.release(exchange)

    async def open(
        self, method: str, path: str, headers: RawHeaders, body: RequestBody, *, stream: bool
    ) -> NativeResponse:
        connections = self._connections
        head = self._request_head(method, path, headers, body)
        timeout = self._stream_timeout if stream else self._total_timeout
        max_duration = connections.max_duration if stream else None
        head_only = method == "HEAD"
        conn, reused = await connections.acquire()
        try:
            await conn.send_request(head, body, timeout, head_only, max_duration)
        except UpstreamUnreachable:
            conn.close()
            if not reused:
                raise
            # A keep-alive connection the backend closed as we reused it: the request
            # never reached it, so one fresh connection is tried before giving up.
            conn = await connections.connect()
            try:
                await conn.send_request(head, body, timeout, head_only, max_duration)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()  # cancelled (client gone) or failed: never reuse a half exchange
            raise
        return NativeResponse(conn, connections)

    async def aclose(self) -> None:
        await self._connections.aclose()
