"""Cluster mode: router replicas share in-flight counts through the state store.

Each admission holds a store lease until its release, and the loads of a decision read
every replica's counts. The engine-telemetry credit stays on the local counts, whose
delta since the sample is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from specrouter.backends import Backend
from specrouter.observe.loadview import GroupView
from specrouter.state import Lease, StateStore


class SharedState(Protocol):
    """The shared state of the replicas (control's `ClusterState`)."""

    @property
    def store(self) -> StateStore: ...

    def status(self) -> dict[str, Any]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ClusterCounts:
    """Leases of this replica's admissions, and the cluster-wide in-flight counts."""

    def __init__(self, state: SharedState, backends: Sequence[Backend]) -> None:
        self.state = state
        self._names = tuple(b.name for b in backends)
        self._known = frozenset(self._names)
        self._leases: dict[int, Lease] = {}

    def acquire(self, key: int, backend: str) -> None:
        self._leases[key] = self.state.store.acquire(backend)

    def release(self, key: int) -> None:
        lease = self._leases.pop(key, None)
        if lease is not None:
            lease.release()  # idempotent: a second release never unbalances a count

    def inflight(self, backends: Iterable[str]) -> int:
        """The cluster-wide in-flight count of `backends` as last read from the store."""
        counts = self.state.store.cluster_inflight()
        return sum(counts.get(name, 0) for name in backends)

    def merged(self, groups: tuple[GroupView, ...]) -> tuple[GroupView, ...]:
        """`groups` with each backend's in-flight at least the cluster's count."""
        counts = self.state.store.cluster_inflight()
        return tuple(
            GroupView(g.name, tuple(
                b if b.name not in self._known else
                replace(b, inflight=max(b.inflight, counts.get(b.name, 0)))
                for b in g.backends))
            for g in groups)

    def details(self) -> dict[str, Any]:
        """The store's health and the cluster-wide in-flight: a degraded store is
        reported, never a reason to be unready (the router serves on its local view)."""
        counts = self.state.store.cluster_inflight()
        return {"state": self.state.status(),
                "cluster_inflight": {n: counts.get(n, 0) for n in self._names}}
