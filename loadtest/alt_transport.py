"""The router with an aiohttp transport, for the `alternatives` measurement only.

    python -m loadtest.alt_transport serve --port 8000 ...   (the `specrouter serve` flags)

`AiohttpUpstream` is the smallest honest aiohttp client behind the `Upstream` protocol:
one `ClientSession` per backend with a keep-alive pool of the configured size, no
decompression, the response body relayed chunk by chunk as it arrives (`iter_any`), the
same timeouts and head limits as the httpx transport. It lives in the load-test tree,
plugged into the app by this launcher, so the product neither imports aiohttp nor offers
a transport that only a benchmark uses.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Mapping, Sequence

import aiohttp

import specrouter.edge.app
from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.proxy.upstream import (
    ChunkWriter,
    RawHeaders,
    RequestBody,
    Upstream,
    UpstreamError,
    UpstreamOverLimit,
    UpstreamTimeout,
    UpstreamUnreachable,
)


class AiohttpResponse:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: RawHeaders = list(response.raw_headers)

    async def iter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    def divert(self, write: ChunkWriter) -> bool:
        return False  # every chunk goes through iter_raw

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # back to the pool for keep-alive
        else:
            self._response.close()  # a body cut short drops the connection


class AiohttpUpstream:
    """aiohttp.ClientSession bound to one backend's base URL."""

    def __init__(self, backend: Backend, timeouts: TimeoutSettings, upstream: UpstreamSettings,
                 limits: LimitSettings) -> None:
        self._base = backend.url.rstrip("/")
        self._max_head_bytes = limits.max_response_head_bytes
        self._max_headers = limits.max_response_headers
        self._stream_timeout = aiohttp.ClientTimeout(
            sock_connect=timeouts.connect, sock_read=timeouts.first_byte,
            total=limits.max_stream_duration_s)
        self._total_timeout = aiohttp.ClientTimeout(
            sock_connect=timeouts.connect, sock_read=timeouts.total)
        self._limit = upstream.max_connections_per_backend
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created in the server's event loop, on first use
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, limit_per_host=self._limit),
                auto_decompress=False, trust_env=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def open(self, method: str, path: str, headers: RawHeaders, body: RequestBody, *,
                   stream: bool) -> AiohttpResponse:
        try:
            response = await self._client().request(
                method, self._base + path, data=bytes(body), allow_redirects=False,
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
                timeout=self._stream_timeout if stream else self._total_timeout)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise UpstreamUnreachable(f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
        raw = list(response.raw_headers)
        if (len(raw) > self._max_headers
                or sum(len(k) + len(v) + 4 for k, v in raw) > self._max_head_bytes):
            response.close()
            raise UpstreamOverLimit("response head over the router's limits")
        return AiohttpResponse(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def create_aiohttp_upstreams(backends: Sequence[Backend], timeouts: TimeoutSettings,
                             upstream: UpstreamSettings, limits: LimitSettings
                             ) -> Mapping[str, Upstream]:
    return {b.name: AiohttpUpstream(b, timeouts, upstream, limits) for b in backends}


def main(argv: list[str]) -> int:
    """`specrouter` with every backend client an AiohttpUpstream (one process: the app
    factory runs in this interpreter, so the replaced factory is the one it calls)."""
    from specrouter.cli import main as cli_main

    setattr(specrouter.edge.app, "create_upstreams", create_aiohttp_upstreams)  # noqa: B010
    return int(cli_main(argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
