"""Where a request goes: the one routing seam of the proxy.

The proxy (`specrouter.edge.app`) never picks a backend itself. It asks a `Router` to
`choose(request) -> Target`, tells it when a request is admitted to and released from a
backend, and reports each upstream outcome. Everything a smarter router needs (load
views, telemetry, policies, breakers, shared state) lives behind this interface, so the
load-aware router replaces `PreferEagleRouter` without touching the request path.

`PreferEagleRouter` is the simple default: the EAGLE-3 server of the healthy group with
the fewest requests in flight, else the baseline server. Its health view is passive only
(a connection failure or 502/503 takes a backend out for a short cool-down), which is
what makes retry-on-another-backend land somewhere useful.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specrouter.config import POOLS, BackendConfig, Pool


@dataclass(frozen=True, slots=True)
class Backend:
    """A configured SGLang server, as the request path sees it."""

    name: str
    url: str
    pool: Pool
    group: str
    api_key: str | None = field(default=None, repr=False)  # never printed

    @classmethod
    def from_config(cls, config: BackendConfig) -> Backend:
        key = config.api_key.get_secret_value() if config.api_key is not None else None
        return cls(config.name, config.url, config.pool, config.group, key)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What routing may look at: cheap facts peeked from the request, never the body.

    `pool` is a pool the route itself requires (other `/v1/*` paths go to the baseline
    pool); `pool_header` is the client's raw `x-specrouter-pool` header, which a policy
    may honour; `exclude` holds backends already tried for this request (retry).
    """

    path: str
    model: str | None = None
    stream: bool = False
    pool: Pool | None = None
    pool_header: str | None = None
    exclude: frozenset[str] = frozenset()
    # requests of a burst still arriving that the decision should count (the router's
    # `settle` says how many)
    burst_ahead: int = 0
    # the request was recalled from EAGLE-3 before its first byte (`Target.recall`): its
    # next target is final
    recalled: bool = False


@dataclass(frozen=True, slots=True)
class Target:
    group: str
    pool: Pool
    backend: Backend
    reason: str
    probe: Probe | None = None  # a shadow probe to send alongside this request
    # Set by the router when the request should leave this backend for another pool if
    # it has not sent its first byte yet (the group switched pools meanwhile): the proxy
    # then closes the upstream request and asks `choose` again with `recalled=True`.
    recall: asyncio.Event | None = None


@dataclass(frozen=True, slots=True)
class Probe:
    """A shadow copy of the request to send to `target` (specrouter.proxy.shadow)."""

    target: Target
    max_tokens: int


class NoBackendAvailable(Exception):
    """No healthy backend can take the request: the proxy answers 503."""


class Router(Protocol):
    """What the proxy needs from routing. Implementations run on one event loop."""

    @property
    def backends(self) -> Sequence[Backend]: ...

    def choose(self, request: RequestInfo) -> Target:
        """The backend for a new request; raise NoBackendAvailable when there is none."""

    def acquire(self, target: Target) -> None:
        """The request was admitted to `target.backend` (called right after `choose`)."""

    def release(self, target: Target) -> None:
        """The request left `target.backend`: called exactly once per `acquire`, in every
        path (success, upstream error, client disconnect, cancellation)."""

    def record_outcome(self, backend: str, ok: bool, error: str | None = None) -> None:
        """Passive health: ok=False for connection errors and 5xx statuses."""

    def healthy(self, backend: str) -> bool: ...

    def inflight(self, backend: str) -> int: ...

    def details(self) -> dict[str, Any]:
        """Router state for GET /ready (JSON-ready)."""

    async def start(self) -> None:
        """Start background work (telemetry, health checks); called at app start-up."""

    async def stop(self) -> None: ...


class InflightTracker:
    """Exact per-backend count of requests the router has in flight.

    Plain integers on one event loop: admission and release cost a dict update, so they
    can sit on the hot path. A release without an admission is a bug in the caller and
    raises instead of letting a count drift below zero.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._counts: dict[str, int] = dict.fromkeys(names, 0)

    def acquire(self, name: str) -> None:
        self._counts[name] += 1

    def release(self, name: str) -> None:
        count = self._counts[name]
        if count <= 0:
            raise RuntimeError(f"release without acquire on backend {name!r}")
        self._counts[name] = count - 1

    def get(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> Mapping[str, int]:
        return dict(self._counts)

    def total(self) -> int:
        return sum(self._counts.values())


class PassiveHealth:
    """A backend that just failed is skipped for `cooldown_s`, then tried again.

    Deliberately minimal: active checks and circuit breakers belong to the load-aware
    router. With no evidence a backend is presumed up.
    """

    def __init__(
        self, names: Iterable[str], cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._down_until: dict[str, float] = dict.fromkeys(names, 0.0)
        self._last_error: dict[str, str | None] = dict.fromkeys(self._down_until)
        self._cooldown_s = cooldown_s
        self._clock = clock

    def record(self, name: str, ok: bool, error: str | None = None) -> None:
        if ok:
            self._down_until[name] = 0.0
        else:
            self._down_until[name] = self._clock() + self._cooldown_s
            self._last_error[name] = error

    def healthy(self, name: str) -> bool:
        until = self._down_until[name]
        return until == 0.0 or self._clock() >= until

    def last_error(self, name: str) -> str | None:
        return self._last_error[name]


class PreferEagleRouter:
    """EAGLE-3 server of the least busy healthy group, else a baseline server."""

    def __init__(self, backends: Sequence[Backend], health: PassiveHealth | None = None) -> None:
        self._backends = tuple(backends)
        self._by_pool: dict[Pool, tuple[Backend, ...]] = {
            pool: tuple(b for b in self._backends if b.pool == pool) for pool in POOLS
        }
        self._groups: dict[str, tuple[Backend, ...]] = {}
        for b in self._backends:
            self._groups[b.group] = (*self._groups.get(b.group, ()), b)
        names = [b.name for b in self._backends]
        self.tracker = InflightTracker(names)
        self.health = health if health is not None else PassiveHealth(names)

    @property
    def backends(self) -> Sequence[Backend]:
        return self._backends

    def choose(self, request: RequestInfo) -> Target:
        retry = "retry_" if request.exclude else ""
        if request.pool is not None:
            backend = self._least_busy(request.pool, request.exclude)
            if backend is not None:
                return Target(backend.group, backend.pool, backend, f"{retry}route_pool")
            other: Pool = "eagle" if request.pool == "baseline" else "baseline"
            return self._pick(other, request.exclude, f"{retry}route_pool_unavailable")
        backend = self._least_busy("eagle", request.exclude)
        if backend is not None:
            return Target(backend.group, "eagle", backend, f"{retry}prefer_eagle")
        return self._pick("baseline", request.exclude, f"{retry}eagle_unavailable")

    def _pick(self, pool: Pool, exclude: frozenset[str], reason: str) -> Target:
        backend = self._least_busy(pool, exclude)
        if backend is None:
            raise NoBackendAvailable("no healthy backend available")
        return Target(backend.group, backend.pool, backend, reason)

    def _least_busy(self, pool: Pool, exclude: frozenset[str]) -> Backend | None:
        """Healthy server of `pool` whose group has the fewest requests in flight."""
        best: Backend | None = None
        best_load = 0
        for backend in self._by_pool[pool]:
            if backend.name in exclude or not self.health.healthy(backend.name):
                continue
            load = sum(self.tracker.get(b.name) for b in self._groups[backend.group])
            if best is None or load < best_load:
                best, best_load = backend, load
        return best

    def acquire(self, target: Target) -> None:
        self.tracker.acquire(target.backend.name)

    def release(self, target: Target) -> None:
        self.tracker.release(target.backend.name)

    def record_outcome(self, backend: str, ok: bool, error: str | None = None) -> None:
        self.health.record(backend, ok, error)

    def healthy(self, backend: str) -> bool:
        return self.health.healthy(backend)

    def inflight(self, backend: str) -> int:
        return self.tracker.get(backend)

    def details(self) -> dict[str, Any]:
        return {
            "router": "prefer_eagle",
            "inflight_total": self.tracker.total(),
            "backends": [
                {
                    "name": b.name, "url": b.url, "pool": b.pool, "group": b.group,
                    "healthy": self.health.healthy(b.name),
                    "inflight": self.tracker.get(b.name),
                    "last_error": self.health.last_error(b.name),
                }
                for b in self._backends
            ],
        }

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
