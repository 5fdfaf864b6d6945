"""The seam between the proxy and its HTTP client: `Upstream.open(...) -> UpstreamResponse`,
its exceptions, and the factory of one client per backend.

Only `specrouter.proxy.transports` knows which HTTP library talks to the backends, so a
transport (another library, HTTP/2, a unix socket) is one new module there. Bodies are
relayed raw: no decompression, no re-chunking, no parsing, so what SGLang sent is what the
client gets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings

RawHeaders = list[tuple[bytes, bytes]]
#: A request body as read once from the client; forwarded without another copy.
RequestBody = bytes | bytearray
#: Writes body bytes straight to the client; False when it cannot take them now (the
#: client's buffer is full, the client left), and the bytes stay with the caller.
ChunkWriter = Callable[[bytes], bool]


class UpstreamError(Exception):
    """The upstream exchange failed (connection lost mid-response, protocol error)."""


class UpstreamUnreachable(UpstreamError):
    """Nothing was received from the backend: safe to try another one."""


class UpstreamTimeout(UpstreamError):
    """The backend did not answer (or went silent) within the configured timeout."""


class UpstreamOverLimit(UpstreamError):
    """The backend's answer passed one of the router's limits (`LimitSettings`: response
    head size or header count, buffered body size, stream duration); the exchange is cut."""


class UpstreamLocalError(UpstreamError):
    """The router could not start the exchange for want of a local resource (no free file
    descriptor: EMFILE, ENFILE). Nothing says the backend is unwell, so it is never
    recorded as a backend failure; the client gets a 503 from the router."""


class UpstreamResponse(Protocol):
    status: int
    headers: RawHeaders

    def iter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamError/UpstreamTimeout on failure."""

    def divert(self, write: ChunkWriter) -> bool:
        """Hand the body bytes that arrive from now on to `write` as they arrive, without
        waking the consumer, until `write` refuses some: those bytes and every later one
        are buffered for `iter_raw` again, and the consumer arms `divert` anew once it
        sent them. Bytes already buffered are never overtaken: while any wait for
        `iter_raw`, new ones are buffered too. The end of the body, or a failure, still
        ends `iter_raw`. False: the transport cannot divert; `iter_raw` carries every byte."""

    async def aclose(self) -> None:
        """Release the exchange. Closing before the body ended drops the connection, which
        is how SGLang learns the client is gone and aborts the request."""


class ExchangeListener(Protocol):
    """Who follows an exchange started on callbacks (`CallbackUpstream.start`). Each
    method is called at most once per exchange except `on_data`; after `on_end` or
    `on_error` nothing more is called. `on_head` runs inside the response parser, before
    any body byte; `on_data` gets each read's body bytes together, except the last
    read's, which come with `on_end`."""

    def on_head(self, status: int, headers: RawHeaders) -> None: ...

    def on_data(self, data: bytes) -> bool:
        """Take the bytes; True (a `ChunkWriter` that never refuses)."""

    def on_end(self, last: bytes) -> None:
        """The answer ended; `last` are its final body bytes not yet given to `on_data`
        (so a consumer can send them with the end, in one write)."""

    def on_error(self, error: UpstreamError) -> None: ...


class Exchange(Protocol):
    """One exchange started on callbacks, to steer while it runs."""

    def pause_reading(self) -> None:
        """Stop reading the backend's answer (the client's buffer is full)."""

    def resume_reading(self) -> None: ...

    def detach(self) -> None:
        """Stop calling the listener: the exchange is left as it stands."""


@runtime_checkable
class CallbackUpstream(Protocol):
    """A transport that can also run an exchange on callbacks: no task, no future."""

    def start(self, method: str, path: str, headers: RawHeaders, body: RequestBody,
              listener: ExchangeListener, *, stream: bool) -> Exchange | None:
        """Send a request on an idle keep-alive connection and report its answer to
        `listener`; None, with nothing sent, when no connection is idle (the caller then
        uses `open`). `stream` selects `open`'s timeouts and limits; a non-stream answer
        may go silent for up to `total`."""

    def finish(self, exchange: Exchange) -> None:
        """Give the exchange's connection back: kept for the next request if the answer
        was read to its end, else closed (which is how SGLang learns the client left)."""


class Upstream(Protocol):
    async def open(
        self, method: str, path: str, headers: RawHeaders, body: RequestBody, *, stream: bool
    ) -> UpstreamResponse:
        """Send a request and return once the final response status and headers arrived
        (interim 1xx answers are skipped).

        `path` includes the query string. `stream` selects the timeout: a streaming
        response must start within `first_byte`, never go silent for longer and, when
        `limits.max_stream_duration_s` is set, end within it; a non-streaming one may take
        up to `total` to start. A head over `limits.max_response_head_bytes` or
        `limits.max_response_headers` raises UpstreamOverLimit; no free descriptor raises
        UpstreamLocalError.
        """

    async def aclose(self) -> None: ...


def create_upstreams(
    backends: Sequence[Backend], timeouts: TimeoutSettings, upstream: UpstreamSettings,
    limits: LimitSettings,
) -> Mapping[str, Upstream]:
    """One client per backend, of the configured transport."""
    if upstream.transport == "httpx":
        from specrouter.proxy.transports.httpx import HttpxUpstream

        return {b.name: HttpxUpstream(b, timeouts, upstream, limits) for b in backends}
    from specrouter.proxy.transports.native import NativeUpstream

    return {b.name: NativeUpstream(b, timeouts, upstream, limits) for b in backends}
