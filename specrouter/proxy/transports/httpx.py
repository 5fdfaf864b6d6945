"""The httpx transport: an `httpx.AsyncClient` per backend, raw bytes relayed as they come."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from specrouter.backends import Backend
from specrouter.config import TimeoutSettings, UpstreamSettings
from specrouter.proxy.upstream import (
    RawHeaders,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)


class HttpxResponse:
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
        self, backend: Backend, timeouts: TimeoutSettings, limits: UpstreamSettings,
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
                max_keepalive_connections=limits.max_idle_per_backend,
            ),
            # Never route loopback engine traffic through a proxy from the environment.
            trust_env=False,
            follow_redirects=False,
            transport=transport,
        )

    async def open(
        self, method: str, path: str, headers: RawHeaders, body: bytes, *, stream: bool
    ) -> HttpxResponse:
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
        return HttpxResponse(response)

    async def aclose(self) -> None:
        await self._client.aclose()


def _describe(exc: Exception) -> str:
    """Exception text for logs and error bodies: the class, never request headers."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
