"""The router's file-descriptor budget: raised at start, checked against the connection
limits, and enforced when a connection is accepted.

Every client connection and every upstream connection is a descriptor, and so are the
health checks, the telemetry polls, Redis and the process's own files. When the soft
RLIMIT_NOFILE runs out, `accept()` and `connect()` fail with EMFILE: clients hang in the
listen backlog and the router's own health checks fail, which looks like every backend
going down. So at start-up:

1. the soft limit is raised to the hard limit (the container runtime's `nofile`);
2. the connection limits are checked against it: client connections (`limits.max_connections`)
   plus the upstream connections they can hold (at most one each while in flight, plus the
   idle keep-alive pool of every backend) plus a reserve for everything else must fit. If
   they do not, the client-connection limit and the idle pool are lowered with a warning;
   if not even `MIN_CLIENT_CONNECTIONS` fit, the router refuses to start;
3. the edge's `BudgetedHttpToolsProtocol` (`specrouter.edge.guard`) serves fewer than
   `max_connections` connections at once and answers the ones beyond with the OpenAI-format
   503 (`code: "overloaded"`), so the descriptors of the reserve are never taken by clients.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Any

from specrouter.config import Settings
from specrouter.edge.accept import ACCEPT_RESERVE
from specrouter.edge.guard import MAX_PENDING_REFUSALS

log = logging.getLogger("specrouter.commands.descriptors")

#: The process itself: stdio, the event loop, signal pipes, listening sockets, log files.
PROCESS_RESERVE = 32
#: Per backend: its health check, telemetry polls, abort and shadow-probe requests.
PER_BACKEND_RESERVE = 4
#: The Redis store's connections (commands and pub/sub) when shared state is on.
REDIS_RESERVE = 8
#: Below this many client connections the router refuses to start.
MIN_CLIENT_CONNECTIONS = 8


class DescriptorBudgetError(RuntimeError):
    """Not even a minimal budget fits the descriptor limit; the message is for the operator."""


@dataclass(frozen=True)
class DescriptorBudget:
    """How the soft RLIMIT_NOFILE is shared out."""

    limit: int  # soft RLIMIT_NOFILE in force
    reserve: int  # process, health checks, telemetry, Redis, pending refusals, accept bursts
    backends: int
    max_connections: int  # client connections (limits.max_connections in force)
    max_idle_per_backend: int  # idle upstream keep-alive connections per backend
    max_connections_per_backend: int
    configured_max_connections: int
    configured_max_idle_per_backend: int

    @property
    def upstream_connections(self) -> int:
        """At most one upstream connection per client connection in flight, plus the idle
        pools, and never more than the pools' own limits."""
        return upstream_bound(self.max_connections, self.backends,
                              self.max_connections_per_backend, self.max_idle_per_backend)

    @property
    def needed(self) -> int:
        return self.reserve + self.max_connections + self.upstream_connections

    @property
    def lowered(self) -> bool:
        return (self.max_connections < self.configured_max_connections
                or self.max_idle_per_backend < self.configured_max_idle_per_backend)

    def describe(self) -> str:
        return (f"descriptors: limit {self.limit}; {self.max_connections} client connections"
                f" + up to {self.upstream_connections} upstream connections ({self.backends}"
                f" backend(s), {self.max_idle_per_backend} idle each) + {self.reserve} in"
                f" reserve = {self.needed}")

    def apply(self, settings: Settings) -> Settings:
        """`settings` with the limits of this budget."""
        return settings.model_copy(update={
            "limits": settings.limits.model_copy(
                update={"max_connections": self.max_connections}),
            "upstream": settings.upstream.model_copy(
                update={"max_idle_per_backend": self.max_idle_per_backend}),
        })

    def overrides(self) -> dict[str, dict[str, int]]:
        """The lowered limits, shaped like `Settings` (empty when nothing was lowered)."""
        if not self.lowered:
            return {}
        return {"limits": {"max_connections": self.max_connections},
                "upstream": {"max_idle_per_backend": self.max_idle_per_backend}}


def upstream_bound(clients: int, backends: int, per_backend: int, idle_per_backend: int) -> int:
    return min(backends * per_backend, clients + backends * idle_per_backend)


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("descriptors: could not raise the soft limit %d to %d: %s",
                        soft, target, exc)
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def reserve_for(settings: Settings) -> int:
    redis = REDIS_RESERVE if settings.redis_url is not None else 0
    return (PROCESS_RESERVE + PER_BACKEND_RESERVE * len(settings.backends) + redis
            + MAX_PENDING_REFUSALS + ACCEPT_RESERVE)


def plan_budget(settings: Settings, limit: int) -> DescriptorBudget:
    """The configured limits if they fit `limit`, else lowered ones; raises
    DescriptorBudgetError when not even MIN_CLIENT_CONNECTIONS fit."""
    backends = len(settings.backends)
    per_backend = settings.upstream.max_connections_per_backend
    clients, idle = settings.limits.max_connections, settings.upstream.max_idle_per_backend
    reserve = reserve_for(settings)
    available = limit - reserve
    if clients + upstream_bound(clients, backends, per_backend, idle) > available:
        # The idle pool gets at most a quarter of what is left; clients the rest.
        idle = min(idle, max(available // 4 // max(backends, 1), 0))
        clients = _most_clients(available, clients, backends, per_backend, idle)
    if clients < min(MIN_CLIENT_CONNECTIONS, settings.limits.max_connections):
        minimum = (reserve + MIN_CLIENT_CONNECTIONS
                   + upstream_bound(MIN_CLIENT_CONNECTIONS, backends, per_backend, 0))
        raise DescriptorBudgetError(
            f"the descriptor limit (RLIMIT_NOFILE) is {limit}, too low to serve even "
            f"{MIN_CLIENT_CONNECTIONS} client connections with {backends} backend(s) and "
            f"{reserve} descriptors in reserve: at least {minimum} are needed. Raise `nofile` "
            f"(ulimit -n, compose `ulimits: nofile`, or the container runtime's limit)")
    return DescriptorBudget(
        limit=limit, reserve=reserve, backends=backends, max_connections=clients,
        max_idle_per_backend=idle, max_connections_per_backend=per_backend,
        configured_max_connections=settings.limits.max_connections,
        configured_max_idle_per_backend=settings.upstream.max_idle_per_backend)


def _most_clients(available: int, configured: int, backends: int, per_backend: int,
                  idle: int) -> int:
    """The largest client-connection count whose descriptors fit (binary search: what
    the connections need grows with their number)."""
    low, high = 0, configured
    while low < high:
        middle = (low + high + 1) // 2
        if middle + upstream_bound(middle, backends, per_backend, idle) <= available:
            low = middle
        else:
            high = middle - 1
    return low


def fit_descriptor_budget(settings: Settings) -> DescriptorBudget:
    """Raise the soft limit, plan the budget and log it (a warning when lowered)."""
    budget = plan_budget(settings, raise_soft_limit())
    if budget.lowered:
        log.warning("%s: lowered from %d client connections and %d idle upstream connections "
                    "per backend to fit; raise `nofile` to serve more",
                    budget.describe(), budget.configured_max_connections,
                    budget.configured_max_idle_per_backend)
    else:
        log.info("%s", budget.describe())
    return budget


def merge_overrides(overrides: dict[str, Any], extra: dict[str, dict[str, int]]) -> dict[str, Any]:
    """`overrides` with the sections of `extra` merged in (one level deep)."""
    merged = dict(overrides)
    for section, values in extra.items():
        merged[section] = {**merged.get(section, {}), **values}
    return merged
