"""A keep-alive GET client for the telemetry poller, on the router's native HTTP/1.1
transport (`specrouter.proxy.transports.native`).

Per poll it costs one request head and one parse in C, where httpx costs its request
and response models, its connection pool's locks and anyio's socket streams: at 10 polls
a second per backend that is a measurable share of the router's CPU. `get` answers
(status, body text), None when the backend gave no answer, and raises `LocalFailure`
when the router lacks a local resource (file descriptors), like the httpx path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.observe.local_errors import LocalFailure, local_resource_error
from specrouter.proxy.transports.native import NativeUpstream
from specrouter.proxy.upstream import UpstreamError, UpstreamLocalError


@dataclass(frozen=True)
class Answer:
    status_code: int
    text: str


class TelemetryFetcher:
    """One small connection pool per backend (one poll at a time needs one connection)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._timeouts = TimeoutSettings(connect=timeout, first_byte=timeout, total=timeout)
        self._upstream = UpstreamSettings(max_connections_per_backend=4,
                                          max_idle_per_backend=2)
        self._limits = LimitSettings()
        self._pools: dict[str, NativeUpstream] = {}

    def _pool(self, backend: Backend) -> NativeUpstream:
        pool = self._pools.get(backend.name)
        if pool is None:
            pool = NativeUpstream(backend, self._timeouts, self._upstream, self._limits)
            self._pools[backend.name] = pool
        return pool

    async def get(self, backend: Backend, path: str) -> Answer | None:
        headers = ([(b"authorization", f"Bearer {backend.api_key}".encode())]
                   if backend.api_key else [])
        try:
            async with asyncio.timeout(self._timeout):
                resp = await self._pool(backend).open("GET", path, headers, b"", stream=False)
                try:
                    body = b"".join([chunk async for chunk in resp.iter_raw()])
                finally:
                    await resp.aclose()
        except UpstreamLocalError as exc:
            raise LocalFailure(f"{path}: {exc}") from exc
        except (UpstreamError, OSError, TimeoutError) as exc:
            local = local_resource_error(exc)
            if local is not None:
                raise LocalFailure(f"{path}: {local}") from exc
            return None
        return Answer(resp.status, body.decode("utf-8", errors="replace"))

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()
