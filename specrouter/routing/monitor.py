"""What the router observes of its backends: in-flight counts and engine telemetry (the
`LoadView`, fed by the `TelemetryPoller`), health checks and breakers, in cluster mode
every replica's counts, and what it learns from them (`learning`: each group's online
cost model and sustained load). It decides nothing: decisions read its group views.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from specrouter.backends import Backend
from specrouter.config import TelemetrySettings
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import EngineSample, GroupView, LoadView
from specrouter.observe.telemetry import TelemetryPoller
from specrouter.routing.cluster import ClusterCounts, SharedState
from specrouter.routing.learning import CostLearning


class BackendMonitor:
    """Runs on one event loop; `on_accept(group)` hears of each new accept-length reading,
    `on_capacity(backend, kv_tokens)` of each telemetry sample's KV pool size."""

    def __init__(
        self,
        backends: Sequence[Backend],
        health: HealthChecker,
        telemetry: TelemetrySettings | None = None,
        state: SharedState | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_ms_per_token: float = 0.0,
    ) -> None:
        telemetry = telemetry if telemetry is not None else TelemetrySettings()
        self.backends = tuple(backends)
        self.health = health
        self.clock = clock
        self.cluster = ClusterCounts(state, backends) if state is not None else None
        self.on_accept: Callable[[str], None] = lambda _group: None
        self.on_capacity: Callable[[str, int], None] = lambda _backend, _kv: None
        self._groups = {b.name: b.group for b in self.backends}
        self.view = LoadView(poll_interval=telemetry.interval_s,
                             idle_poll_interval=telemetry.idle_poll_s)
        for b in self.backends:
            self.view.add_backend(b.name, b.group, b.pool)
        self.learning = CostLearning(self.view, half_life_s=telemetry.learn_half_life_s,
                                     prior_weight=telemetry.learn_prior_weight,
                                     sustained_s=telemetry.sustained_s,
                                     sustained_fall_s=telemetry.sustained_fall_s,
                                     prefill_ms_per_token=prefill_ms_per_token,
                                     kv_room=telemetry.learn_kv_room)
        self.poller: TelemetryPoller | None = None
        if telemetry.enabled:
            self.poller = TelemetryPoller(
                backends=self.backends,
                publish=self._publish_sample, publish_accept=self._publish_accept,
                poll_started=self.view.poll_started,
                interval=telemetry.interval_s, idle_interval=telemetry.idle_poll_s,
                busy=self.busy, timeout=telemetry.timeout_s,
            )

    def busy(self, backend: str) -> bool:
        """Whether any replica has a request in flight to `backend`'s group (its servers
        share a GPU: what one runs changes the other's steps)."""
        group = self._groups[backend]
        if self.view.group_inflight(group) > 0:
            return True
        return self.cluster is not None and self.cluster.inflight(self.view.members(group)) > 0

    def groups(self, now: float, exclude: frozenset[str] = frozenset(),
               sustained: bool = True) -> tuple[GroupView, ...]:
        """Every group; a backend in `exclude` counts as unhealthy. With `sustained` off
        the views carry no sustained load: a decision adds it to the one group it takes
        (`with_sustained`) instead of computing one per group of the cluster."""
        order = self.view.order
        flags = self.health.flags(order, now)
        if exclude:
            flags = tuple(ok and name not in exclude
                          for name, ok in zip(order, flags, strict=True))
        groups = self.view.flagged_snapshot(now, flags)
        if self.cluster is not None:
            groups = self.cluster.merged(groups)
        if not sustained:
            return groups
        return tuple(self.with_sustained(g, now) for g in groups)

    def with_sustained(self, group: GroupView, now: float) -> GroupView:
        """`group` with its sustained load at `now`."""
        return group.with_sustained(self.learning.sustained(group.name, now))

    def group(self, name: str, now: float) -> GroupView:
        """One group with this replica's own counts."""
        return self.with_sustained(
            self.view.group_view(name, now, lambda n: self.health.healthy(n, now)), now)

    def acquire(self, key: int, backend: str, prefill_tokens: float = 0.0,
                prompt_tokens: float = 0.0, own: bool = False) -> None:
        """A request goes to `backend` with `prefill_tokens` uncached prompt tokens, of
        `prompt_tokens` (0: not known); `own`: the router's own (`Target.own`)."""
        now = self.clock()
        self.view.acquire(backend, now)
        group = self._groups[backend]
        if self.poller is not None and self.view.group_inflight(group) == 1:
            for name in self.view.members(group):  # an idle group's next polls come within
                self.poller.wake(name)  # an interval
        self.learning.inflight_changed(backend, now, +1 if own else 0)
        self.learning.admitted(backend, now, prefill_tokens, prompt_tokens)
        if self.cluster is not None:
            self.cluster.acquire(key, backend)

    def release(self, key: int, backend: str, own: bool = False) -> None:
        now = self.clock()
        self.view.release(backend, now)
        self.learning.inflight_changed(backend, now, -1 if own else 0)
        if self.cluster is not None:
            self.cluster.release(key)

    async def start(self) -> None:
        if self.cluster is not None:
            await self.cluster.state.start()  # the shared policy is in force first
        await self.health.start()
        if self.poller is not None:
            await self.poller.start()

    async def stop(self) -> None:
        if self.poller is not None:
            await self.poller.stop()
        await self.health.stop()
        if self.cluster is not None:
            await self.cluster.state.stop()

    def cluster_details(self) -> dict[str, Any]:
        return {} if self.cluster is None else self.cluster.details()

    def describe(self, backend: Backend, now: float) -> dict[str, Any]:
        """One backend in GET /ready and GET /policy."""
        load = self.view.backends[backend.name]
        health = self.health.describe(backend.name)
        sample = load.sample
        telemetry: dict[str, Any] = {
            "source": self.poller.source_of(backend.name) if self.poller else None,
            "age_s": load.age(now), "stale": load.is_stale(now, self.view.poll_interval),
            "snapshot_age_s": None if sample is None else sample.snapshot_age,
            "engine_load": load.engine_load(now, self.view.poll_interval),
            "running": None if sample is None else sample.running,
            "waiting": None if sample is None else sample.waiting,
        }
        if backend.pool == "eagle":
            telemetry["accept"] = {
                "windowed": load.accept_length, "lifetime": load.accept_lifetime,
                "source": self.poller.accept_status(backend.name) if self.poller else None,
            }
        return {
            "name": backend.name, "url": backend.url, "pool": backend.pool,
            "group": backend.group, "healthy": health["healthy"], "breaker": health["breaker"],
            "inflight": load.inflight, "last_error": health["last_error"],
            "check_path": health["check_path"], "accept_length": load.accept_length,
            "telemetry": telemetry,
        }

    def _publish_sample(self, name: str, sample: EngineSample) -> None:
        self.view.publish(name, sample)
        self.learning.sample(name, sample)
        if sample.kv_tokens is not None:
            self.on_capacity(name, sample.kv_tokens)
        if sample.accept_length is not None:
            self.on_accept(self._groups[name])

    def _publish_accept(self, name: str, sample: EngineSample) -> None:
        self.view.publish_accept(name, sample)
        if sample.accept_length is not None:
            self.on_accept(self._groups[name])
