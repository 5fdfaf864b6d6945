"""The seam between the proxy and its HTTP client: `Upstream.open(...) -> UpstreamResponse`,
three exceptions, and the factory of one client per backend.

Only `specrouter.proxy.transports` knows which HTTP library talks to the backends, so a
transport (another library, HTTP/2, a unix socket) is one new module there. Bodies are
relayed raw: no decompression, no re-chunking, no parsing, so what SGLang sent is what the
client gets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from specrouter.backends import Backend
from specrouter.config import TimeoutSettings, UpstreamSettings

RawHeaders = list[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The upstream exchange failed (connection lost mid-response, protocol error)."""


class UpstreamUnreachable(UpstreamError):
    """Nothing was received from the backend: safe to try another one."""


class UpstreamTimeout(UpstreamError):
    """The backend did not answer (or went silent) within the configured timeout."""


class UpstreamResponse(Protocol):
    status: int
    headers: RawHeaders

    def iter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamError/UpstreamTimeout on failure."""

    async def aclose(self) -> None:
        """Release the exchange. Closing before the body ended drops the connection, which
        is how SGLang learns the client is gone and aborts the request."""


class Upstream(Protocol):
    async def open(
        self, method: str, path: str, headers: RawHeaders, body: bytes, *, stream: bool
    ) -> UpstreamResponse:
        """Send a request and return once the response status and headers arrived.

        `path` includes the query string. `stream` selects the timeout: a streaming
        response must start within `first_byte` and never go silent for longer; a
        non-streaming one may take up to `total` to start.
        """

    async def aclose(self) -> None: ...


def create_upstreams(
    backends: Sequence[Backend], timeouts: TimeoutSettings, upstream: UpstreamSettings
) -> Mapping[str, Upstream]:
    """One client per backend, of the configured transport."""
    if upstream.transport == "httpx":
        from specrouter.proxy.transports.httpx import HttpxUpstream

        return {b.name: HttpxUpstream(b, timeouts, upstream) for b in backends}
    from specrouter.proxy.transports.native import NativeUpstream

    return {b.name: NativeUpstream(b, timeouts, upstream) for b in backends}
