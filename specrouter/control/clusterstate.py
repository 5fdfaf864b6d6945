"""The router on shared state: one policy and one load view for every replica.

`ClusterState` joins a `StateStore` (specrouter.state) to the router: the policy lives in
a `StorePolicyHolder`, the store's in-flight counts are what the router's load signal reads
(`cluster_inflight`), and every admission holds a `Lease` until the proxy releases it.
`StateCollector` exports the store's health to Prometheus. The store being unreachable
never fails a request: reads are local.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specrouter.control.storeholder import StorePolicyHolder
from specrouter.routing.policy import Policy
from specrouter.state import StateSettings, StateStore, make_store
from specrouter.tasks import cancel_and_wait

#: How often the health watcher samples the store (counts degraded transitions).
WATCH_INTERVAL_S = 0.1


class ClusterState:
    """The store, the policy holder on it, and the health watcher: started and stopped with
    the router (`LoadAwareRouter.start/stop`)."""

    def __init__(self, store: StateStore, initial: Policy) -> None:
        self.store = store
        self.holder = StorePolicyHolder(store, initial)
        self.degraded_transitions = 0
        self._was_degraded = False
        self._watch: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: StateSettings, initial: Policy,
                      replica_id: str | None = None) -> ClusterState:
        return cls(make_store(settings, replica_id), initial)

    async def start(self) -> None:
        await self.store.start()  # never raises because Redis is down
        await self.holder.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_health())

    async def stop(self) -> None:
        if self._watch is not None:
            await cancel_and_wait([self._watch])
        await self.holder.stop()
        await self.store.close()

    def status(self) -> dict[str, Any]:
        status = self.store.status()
        status["degraded_transitions"] = self.degraded_transitions
        return status

    async def _watch_health(self) -> None:
        """Counts transitions into degraded for the metrics (the store logs them)."""
        while True:
            self._observe()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _observe(self) -> None:
        degraded = bool(self.store.status().get("degraded"))
        if degraded and not self._was_degraded:
            self.degraded_transitions += 1
        self._was_degraded = degraded


class StateCollector(Collector):
    """specrouter_state_* series, read from the store at scrape time."""

    def __init__(self, state: ClusterState) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        self._state._observe()  # a transition between two watcher ticks still counts
        status = self._state.status()
        backend = str(status.get("backend", "memory"))
        connected = GaugeMetricFamily("specrouter_state_connected",
                                      "1 if the state store is reachable", labels=["backend"])
        connected.add_metric([backend], 1.0 if status.get("connected") else 0.0)
        degraded = GaugeMetricFamily("specrouter_state_degraded",
                                     "1 while the router serves on its local view only",
                                     labels=["backend"])
        degraded.add_metric([backend], 1.0 if status.get("degraded") else 0.0)
        age = GaugeMetricFamily("specrouter_state_last_sync_age_seconds",
                                "Age of the cluster view of other replicas' counts")
        if status.get("last_sync_age_s") is not None:
            age.add_metric([], float(status["last_sync_age_s"]))
        replicas = GaugeMetricFamily("specrouter_state_replicas_seen",
                                     "Router replicas in the last cluster view")
        replicas.add_metric([], float(status.get("replicas_seen") or 0))
        transitions = CounterMetricFamily("specrouter_state_degraded_transitions",
                                          "Times the state store became unreachable")
        transitions.add_metric([], float(self._state.degraded_transitions))
        cluster = GaugeMetricFamily("specrouter_cluster_inflight_requests",
                                    "Requests in flight per backend over all replicas "
                                    "(this replica's view)", labels=["backend"])
        for name, count in sorted(self._state.store.cluster_inflight().items()):
            cluster.add_metric([name], float(count))
        yield from (connected, degraded, age, replicas, transitions, cluster)
