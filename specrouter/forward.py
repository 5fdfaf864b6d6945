"""The upstream HTTP transport: one pooled keep-alive client per backend.

This is the only module that knows which HTTP client library the router uses. The proxy
sees `Upstream.open(...) -> UpstreamResponse` and three exceptions, so the transport can
be swapped (another library, HTTP/2, a unix socket) by writing one class here.

Bytes are relayed raw (`aiter_raw`): no decompression, no re-chunking, no parsing, so
what SGLang sent is what the client gets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import httpx

from specrouter.config import LimitSettings, TimeoutSettings
from specrouter.router import Backend

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


class _HttpxResponse:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: RawHeaders = response.headers.raw

    async def iter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(_describe(exc)) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(_describe(exc)) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """httpx.AsyncClient bound to one backend's base URL."""

    def __init__(
        self, backend: Backend, timeouts: TimeoutSettings, limits: LimitSettings,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._stream_timeout = httpx.Timeout(
            connect=timeouts.connect, read=timeouts.first_byte,
            write=timeouts.write, pool=timeouts.connect,
        )
        self._total_timeout = httpx.Timeout(
            connect=timeouts.connect, read=timeouts.total,
            write=timeouts.write, pool=timeouts.connect,
        )
        self._client = httpx.AsyncClient(
            base_url=backend.url,
            timeout=self._total_timeout,
            limits=httpx.Limits(
                max_connections=limits.max_connections_per_backend,
                max_keepalive_connections=limits.max_keepalive_per_backend,
            ),
            # Never route loopback engine traffic through a proxy from the environment.
            trust_env=False,
            follow_redirects=False,
            transport=transport,
        )

    async def open(
        self, method: str, path: str, headers: RawHeaders, body: bytes, *, stream: bool
    ) -> _HttpxResponse:
        request = self._client.build_request(
            method, path, headers=headers, content=body,
            timeout=self._stream_timeout if stream else self._total_timeout,
        )
        try:
            response = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise UpstreamUnreachable(_describe(exc)) from exc
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(_describe(exc)) from exc
        except (httpx.RemoteProtocolError, httpx.NetworkError) as exc:
            # Dropped before any response byte (e.g. a keep-alive connection the server
            # closed as we reused it): nothing reached the client, so it may be retried.
            raise UpstreamUnreachable(_describe(exc)) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(_describe(exc)) from exc
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()


def _describe(exc: Exception) -> str:
    """Exception text for logs and error bodies: the class, never request headers."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def create_upstreams(
    backends: Sequence[Backend], timeouts: TimeoutSettings, limits: LimitSettings
) -> Mapping[str, Upstream]:
    return {b.name: HttpxUpstream(b, timeouts, limits) for b in backends}
