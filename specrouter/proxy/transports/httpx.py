"""The httpx transport: an `httpx.AsyncClient` per backend, raw bytes relayed as they come.

httpcore skips interim 1xx answers and refuses a response head over 100 KiB (h11's
incomplete-event limit); the router's own head limits apply within that.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.observe.local_errors import local_resource_error
from specrouter.proxy.upstream import (
    ChunkWriter,
    RawHeaders,
    RequestBody,
    UpstreamError,
    UpstreamLocalError,
    UpstreamOverLimit,
    UpstreamTimeout,
    UpstreamUnreachable,
)


class HttpxResponse:
    __slots__ = ("_deadline", "_limit_s", "_response", "headers", "status")

    def __init__(self, response: httpx.Response, limit_s: float | None) -> None:
        self._response = response
        self._limit_s = limit_s
        loop = asyncio.get_running_loop()
        self._deadline = None if limit_s is None else loop.time() + limit_s
        self.status = response.status_code
        self.headers: RawHeaders = response.headers.raw

    async def iter_raw(self) -> AsyncIterator[bytes]:
        chunks = self._response.aiter_raw()
        try:
            while True:
                try:  # the deadline bounds the waits only, never the consumer's work
                    async with asyncio.timeout_at(self._deadline):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise UpstreamOverLimit(f"the answer took longer than the router's "
                                            f"{self._limit_s:g} s stream limit") from None
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(_describe(exc)) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(_describe(exc)) from exc

    def divert(self, write: ChunkWriter) -> bool:
        return False  # httpx reads the body only when asked: every chunk goes through iter_raw

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """httpx.AsyncClient bound to one backend's base URL."""

    def __init__(
        self, backend: Backend, timeouts: TimeoutSettings, upstream: UpstreamSettings,
        limits: LimitSettings, transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._max_head_bytes = limits.max_response_head_bytes
        self._max_headers = limits.max_response_headers
        self._max_duration = limits.max_stream_duration_s
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
                max_connections=upstream.max_connections_per_backend,
                max_keepalive_connections=upstream.max_idle_per_backend,
            ),
            # Never route loopback engine traffic through a proxy from the environment.
            trust_env=False,
            follow_redirects=False,
            transport=transport,
        )

    async def open(
        self, method: str, path: str, headers: RawHeaders, body: RequestBody, *, stream: bool
    ) -> HttpxResponse:
        request = self._client.build_request(
            method, path, headers=headers, content=bytes(body),  # httpx takes bytes only
            timeout=self._stream_timeout if stream else self._total_timeout,
        )
        try:
            async with asyncio.timeout(self._max_duration if stream else None):
                response = await self._client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamOverLimit(f"no answer within the router's {self._max_duration:g} s "
                                    "stream limit") from None
        except httpx.ConnectError as exc:
            local = local_resource_error(exc)
            if local is not None:
                raise UpstreamLocalError(f"cannot open a connection: {local}") from exc
            raise UpstreamUnreachable(_describe(exc)) from exc
        except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise UpstreamUnreachable(_describe(exc)) from exc
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(_describe(exc)) from exc
        except (httpx.RemoteProtocolError, httpx.NetworkError) as exc:
            # Dropped before any response byte (e.g. a keep-alive connection the server
            # closed as we reused it): nothing reached the client, so it may be retried.
            raise UpstreamUnreachable(_describe(exc)) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(_describe(exc)) from exc
        problem = self._head_problem(response.headers.raw)
        if problem is not None:
            await response.aclose()
            raise UpstreamOverLimit(problem)
        return HttpxResponse(response, self._max_duration if stream else None)

    def _head_problem(self, headers: RawHeaders) -> str | None:
        if len(headers) > self._max_headers:
            return f"response head has more than the router's limit of {self._max_headers} headers"
        if sum(len(k) + len(v) + 4 for k, v in headers) > self._max_head_bytes:
            return f"response head exceeds the router's {self._max_head_bytes} byte limit"
        return None

    async def aclose(self) -> None:
        await self._client.aclose()


def _describe(exc: Exception) -> str:
    """Exception text for logs and error bodies: the class, never request headers."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
