"""The load-aware router: EAGLE-3 while a GPU group is lightly loaded, baseline when loaded.

It implements the proxy's `Router` seam (`specrouter.routing.router`) by joining the pure parts:
- `LoadView` (exact in-flight counts from `acquire`/`release`, engine telemetry from the
  background `TelemetryPoller`, with the credit rule and staleness);
- `HealthChecker` (active checks, passive outcomes, per-backend breakers);
- `choose_group` then `decide` (policy.py) with the hysteresis state of each group;
- the `PolicyHolder`, read once per request.

`choose()` does no I/O and costs O(backends): it reads views that background tasks keep
fresh. Only new requests are decided; a request in flight stays on its backend.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specrouter.config import POOLS, Pool, TelemetrySettings
from specrouter.control.holder import PolicyHolder
from specrouter.control.metrics import BackendLive, LiveMetrics, RouterMetrics
from specrouter.errors import RouterError
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import BackendView, EngineSample, GroupView, LoadSignal, LoadView
from specrouter.observe.telemetry import TelemetryPoller, TelemetryTarget
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.policy import (
    POOL_HEADER,
    GroupState,
    HeaderError,
    Hints,
    NoHealthyPool,
    Policy,
    choose_group,
    decide,
    group_report,
    parse_pool_header,
    smooth_accept,
)
from specrouter.routing.router import Backend, NoBackendAvailable, Probe, RequestInfo, Target

if TYPE_CHECKING:
    from specrouter.control.clusterstate import ClusterState
    from specrouter.state import Lease

_ARRIVING = "(arriving)"
_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
# EAGLE-3 decisions that a switch of the group to the baseline does not undo: the client
# asked for EAGLE-3, or the group has no baseline server to move to.
_KEEPS_EAGLE = frozenset({"client_override", "baseline_unhealthy"})


class InvalidPoolHeader(RouterError):
    """A malformed `x-specrouter-pool` header while client overrides are allowed: 400."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, param=POOL_HEADER, code="invalid_pool_header")


class LoadAwareRouter:
    """See the module docstring. Runs on one event loop; not thread-safe."""

    def __init__(
        self,
        backends: Sequence[Backend],
        policy: PolicyHolder,
        health: HealthChecker,
        telemetry: TelemetrySettings | None = None,
        metrics: RouterMetrics | None = None,
        cost_models: Mapping[str, GroupCostModel] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        arrival_window_s: float = 0.0,
        state: ClusterState | None = None,
        arrival_max_wait_s: float = 0.016,
        recall_unstarted: bool = False,
    ) -> None:
        self._backends = tuple(backends)
        # Cluster mode (issue 5): loads read every replica's in-flight counts from the
        # store, and each admission holds a store lease until its release.
        self._cluster = state
        self._leases: dict[int, Lease] = {}
        self._arrival_window_s = arrival_window_s
        self._arrival_max_wait_s = max(arrival_window_s, arrival_max_wait_s)
        self._arriving = 0  # requests inside `settle`, not yet decided
        self._arrivals = 0  # generation requests seen by `settle`, ever
        self._last_arrival = float("-inf")  # event-loop time of the latest generation request
        # Recall (AdmissionSettings.recall_unstarted): per group, the recall events of its
        # EAGLE-3 streams admitted and not yet released, by id(target). The proxy stops
        # watching an event once the stream's first byte arrived, so one set later is moot.
        self._recall_unstarted = recall_unstarted
        self._recallable: dict[str, dict[int, asyncio.Event]] = {}
        self._by_name = {b.name: b for b in self._backends}
        self._policy = policy
        self._health = health
        self._metrics = metrics
        self._cost_models = dict(cost_models or {})
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        telemetry = telemetry if telemetry is not None else TelemetrySettings()
        self.view = LoadView(poll_interval=telemetry.interval_s)
        for b in self._backends:
            self.view.add_backend(b.name, b.group, b.pool)
        self._states: dict[str, GroupState] = {g: GroupState() for g in self.view.group_names()}
        self.poller: TelemetryPoller | None = None
        if telemetry.enabled:
            self.poller = TelemetryPoller(
                targets=[TelemetryTarget(b.name, b.url, b.api_key, b.pool == "eagle")
                         for b in self._backends],
                publish=self._publish_sample, publish_accept=self._publish_accept,
                poll_started=self.view.poll_started,
                interval=telemetry.interval_s, timeout=telemetry.timeout_s,
            )
        if metrics is not None:
            metrics.attach(self.live_metrics)

    # -- the Router protocol ---------------------------------------------------------------

    @property
    def backends(self) -> Sequence[Backend]:
        return self._backends

    @property
    def policy(self) -> Policy:
        return self._policy.current

    async def settle(self, request: RequestInfo) -> int:
        """Before the first `choose`: a request that would go to EAGLE-3 (or carry a
        shadow probe to it) waits the arrival window, and the requests arriving meanwhile
        count as load of its decision. Returns how many more requests its decision should
        expect (`RequestInfo.burst_ahead`).

        Why: a burst that arrives at one instant (closed-loop clients, a batch job) would
        otherwise send its first request to EAGLE-3 at an idle group; that request then
        shares the GPU with the baseline's batch for its whole life and slows all of it.
        A burst still arriving when the wait reaches its cap is taken to go on at the
        rate seen so far for as long again: 64 closed-loop clients opening connections
        reach the router over more than the 16 ms cap, and without that a request decided
        at the cap, having seen fewer than 44 of them (the goodput crossover at accept
        2.5), still went to EAGLE-3. In the baseline regime nothing waits.
        """
        if (self._arrival_window_s <= 0 or request.pool is not None or request.exclude
                or request.path not in _GENERATION_PATHS):
            return 0
        loop = asyncio.get_running_loop()
        self._last_arrival = arrived = loop.time()
        self._arrivals += 1
        seen_before = self._arrivals
        policy = self._policy.current
        if policy.mode != "auto" or not self._eagle_next(policy):
            return 0
        self._arriving += 1
        try:
            # Wait for a quiet window: a burst whose requests keep arriving (each one
            # opening its own connection) is seen whole, up to a cap.
            cap = arrived + self._arrival_max_wait_s
            while True:
                quiet_at = self._last_arrival + self._arrival_window_s
                now = loop.time()
                if now >= min(quiet_at, cap):
                    return self._arrivals - seen_before if quiet_at > cap else 0
                await asyncio.sleep(min(quiet_at, cap) - now)
        finally:
            self._arriving -= 1

    def _eagle_next(self, policy: Policy) -> bool:
        """Whether a request arriving now would be sent to EAGLE-3 by the strategy, or
        carry a probe to it (a dry run of `choose`): a burst arriving behind it would
        change both. A group with no healthy baseline server sends everything to
        EAGLE-3 whatever arrives, so waiting for the burst could change nothing."""
        now = self._clock()
        groups = self._with_arrivals(self._views(now, frozenset()))
        live = [g for g in groups if g.any_healthy]
        if not live:
            return False
        group = min(live, key=lambda g: g.load(policy.load_signal))
        if not group.pool_healthy("baseline"):
            return False
        try:
            decision = decide(policy, group, self._states[group.name], Hints(), now,
                              self._cost_models.get(group.name))
        except NoHealthyPool:
            return False
        return decision.pool == "eagle" or decision.probe

    def _with_arrivals(self, groups: tuple[GroupView, ...],
                       expected: int = 0) -> tuple[GroupView, ...]:
        """Group views with the requests still inside their arrival window (and the
        `expected` ones of a burst still arriving) spread over the live groups (the group
        choice will spread them so), as one extra load entry that no request can be sent
        to."""
        live = sum(1 for g in groups if g.any_healthy)
        pending_requests = self._arriving + expected
        if not pending_requests or not live:
            return groups
        share = pending_requests / live
        pending = BackendView(name=_ARRIVING, pool="baseline", healthy=False,
                              inflight=int(share), engine=share, telemetry_age=0.0,
                              stale=False, accept_length=None, accept_seen_at=None)
        return tuple(GroupView(g.name, (*g.backends, pending)) for g in groups)

    def choose(self, request: RequestInfo) -> Target:
        now = self._clock()
        policy = self._policy.current
        groups = self._views(now, request.exclude)
        if (self._arriving or request.burst_ahead) and request.pool is None:
            groups = self._with_arrivals(groups, request.burst_ahead)
        if request.pool is not None:
            target = self._route_pool(groups, request.pool, policy.load_signal)
        else:
            target = self._decide(groups, policy, request, now)
        self._health.allow_request(target.backend.name, now)  # claims a half-open probe
        if self._metrics is not None:
            self._metrics.observe_decision(target.pool, target.reason)
            if request.recalled:
                self._metrics.observe_recall(target.group)
        return target

    def acquire(self, target: Target) -> None:
        self.view.acquire(target.backend.name)
        if target.recall is not None:
            self._recallable.setdefault(target.group, {})[id(target)] = target.recall
        if self._cluster is not None:
            self._leases[id(target)] = self._cluster.store.acquire(target.backend.name)

    def release(self, target: Target) -> None:
        self.view.release(target.backend.name)
        if target.recall is not None:
            self._recallable.get(target.group, {}).pop(id(target), None)
        if self._cluster is not None:
            lease = self._leases.pop(id(target), None)
            if lease is not None:
                lease.release()  # idempotent: a second release can never unbalance a count

    def record_outcome(self, backend: str, ok: bool, error: str | None = None) -> None:
        self._health.record_outcome(backend, ok, error)
        if not ok and self._metrics is not None:
            self._metrics.observe_upstream_error(backend)

    def healthy(self, backend: str) -> bool:
        return self._health.healthy(backend)

    def inflight(self, backend: str) -> int:
        return self.view.backends[backend].inflight

    async def start(self) -> None:
        if self._cluster is not None:
            await self._cluster.start()  # the shared policy is in force before any request
        await self._health.start()
        if self.poller is not None:
            await self.poller.start()

    async def stop(self) -> None:
        if self.poller is not None:
            await self.poller.stop()
        await self._health.stop()
        if self._cluster is not None:
            await self._cluster.stop()

    # -- telemetry -------------------------------------------------------------------------

    def _publish_sample(self, name: str, sample: EngineSample) -> None:
        self.view.publish(name, sample)
        if sample.accept_length is not None:
            self._observe_accept(name)

    def _publish_accept(self, name: str, accept_length: float, received_at: float) -> None:
        self.view.publish_accept_length(name, accept_length, received_at)
        self._observe_accept(name)

    def _observe_accept(self, name: str) -> None:
        """Fold an EAGLE server's new accept-length reading into its group's average now,
        not at the group's next decision: between two requests many readings may arrive,
        and each must count once (decide() skips a reading already folded in)."""
        group = self._by_name[name].group
        now = self._clock()
        view = self.view.group_view(group, now, lambda n: self._health.healthy(n, now))
        self._states[group] = smooth_accept(self._policy.current, view, self._states[group],
                                            self._cost_models.get(group))

    # -- decisions -------------------------------------------------------------------------

    def _views(self, now: float, exclude: frozenset[str]) -> tuple[GroupView, ...]:
        health = self._health

        def usable(name: str) -> bool:
            return name not in exclude and health.healthy(name, now)

        return self._clustered(self.view.snapshot(now, usable))

    def _clustered(self, groups: tuple[GroupView, ...]) -> tuple[GroupView, ...]:
        """In cluster mode the in-flight of each backend is every replica's (the store's
        cluster view, which holds this replica's exact counts); the engine-telemetry credit
        stays on the local counts, whose delta since the sample is exact."""
        if self._cluster is None:
            return groups
        counts = self._cluster.store.cluster_inflight()
        return tuple(
            GroupView(g.name, tuple(
                b if b.name not in self._by_name else
                replace(b, inflight=max(b.inflight, counts.get(b.name, 0)))
                for b in g.backends))
            for g in groups)

    def _hints(self, policy: Policy, request: RequestInfo) -> Hints:
        if not policy.allow_client_override:
            return Hints()  # the header is ignored, even a malformed one
        try:
            return Hints(parse_pool_header(request.pool_header))
        except HeaderError as exc:
            raise InvalidPoolHeader(str(exc)) from None

    def _decide(
        self, groups: tuple[GroupView, ...], policy: Policy, request: RequestInfo, now: float
    ) -> Target:
        group = choose_group(groups, policy.load_signal, self._rng)
        if group is None:
            raise NoBackendAvailable("no healthy backend in any GPU group")
        decision = decide(policy, group, self._states[group.name], self._hints(policy, request),
                          now, self._cost_models.get(group.name))
        recalls = self._recalls(policy)
        if (recalls and self._states[group.name].pool == "eagle"
                and decision.state.pool == "baseline"):
            self._recall(group.name)
        self._states[group.name] = decision.state
        recall = (asyncio.Event() if recalls and decision.pool == "eagle" and request.stream
                  and not request.recalled and decision.reason not in _KEEPS_EAGLE else None)
        backend = self._least_loaded(group.healthy_servers(decision.pool), policy.load_signal)
        probe = None
        if decision.probe:
            server = self._least_loaded(group.healthy_servers("eagle"), policy.load_signal)
            probe = Probe(Target(group.name, "eagle", server, "goodput_probe"),
                          policy.goodput_probe_tokens)
            if self._metrics is not None:
                self._metrics.observe_probe(server.name)
        return Target(group.name, decision.pool, backend, decision.reason, probe, recall)

    def _recalls(self, policy: Policy) -> bool:
        """Whether EAGLE-3 streams are recalled when their group switches to the baseline:
        only where the strategy switches a whole group (threshold, goodput). Under
        `overflow` the EAGLE-3 requests already admitted are within its cap and stay."""
        return (self._recall_unstarted and policy.mode == "auto"
                and policy.strategy in ("threshold", "goodput"))

    def _recall(self, group: str) -> None:
        """The group switched to the baseline: its EAGLE-3 streams still waiting for their
        first byte leave for the baseline too, as they would go if they arrived now (the
        tail of a burst spread wider than the arrival window)."""
        for event in self._recallable.pop(group, {}).values():
            event.set()

    def _route_pool(
        self, groups: tuple[GroupView, ...], pool: Pool, signal: LoadSignal
    ) -> Target:
        """A route that needs one pool: its server in the least loaded group that has one,
        else any healthy server of the other pool."""
        for wanted, reason in ((pool, "route_pool"), (_other(pool), "route_pool_unavailable")):
            candidates = [g for g in groups if g.pool_healthy(wanted)]
            if candidates:
                group = min(candidates, key=lambda g: g.load(signal))
                backend = self._least_loaded(group.healthy_servers(wanted), signal)
                return Target(group.name, wanted, backend, reason)
        raise NoBackendAvailable("no healthy backend in any GPU group")

    def _least_loaded(self, servers: Sequence[BackendView], signal: LoadSignal) -> Backend:
        best = min(servers, key=lambda b: b.load(signal))
        return self._by_name[best.name]

    # -- introspection ---------------------------------------------------------------------

    def group_states(self) -> Mapping[str, GroupState]:
        return dict(self._states)

    def details(self) -> dict[str, Any]:
        """For GET /ready: the router, its policy version and every backend."""
        now = self._clock()
        details: dict[str, Any] = {
            "router": "load_aware",
            "policy_version": self._policy.current.version,
            "inflight_total": sum(b.inflight for b in self.view.backends.values()),
            "backends": [self._backend_info(b, now) for b in self._backends],
        }
        details.update(self._cluster_details())
        return details

    def _cluster_details(self) -> dict[str, Any]:
        """The store's health and the cluster-wide in-flight (a degraded store is reported,
        never a reason to be unready: the router serves on its local view)."""
        if self._cluster is None:
            return {}
        counts = self._cluster.store.cluster_inflight()
        return {"state": self._cluster.status(),
                "cluster_inflight": {b.name: counts.get(b.name, 0) for b in self._backends}}

    def live_view(self) -> dict[str, Any]:
        """For GET /policy: per group the load, the current choice and why (and the cost
        model's predictions when there is one); per backend health, breaker, in-flight,
        telemetry age and accept length."""
        now = self._clock()
        policy = self._policy.current
        groups = self._views(now, frozenset())
        return {
            "groups": [
                group_report(policy, g, self._states[g.name], now, self._cost_models.get(g.name))
                for g in groups
            ],
            "backends": [self._backend_info(b, now) for b in self._backends],
            **self._cluster_details(),
        }

    def _backend_info(self, backend: Backend, now: float) -> dict[str, Any]:
        load = self.view.backends[backend.name]
        health = self._health.describe(backend.name)
        stale = load.is_stale(now, self.view.poll_interval)
        telemetry: dict[str, Any] = {
            "source": self.poller.source_of(backend.name) if self.poller else None,
            "age_s": load.age(now), "stale": stale,
            "engine_load": load.engine_load(now, self.view.poll_interval),
            "running": None if load.sample is None else load.sample.running,
            "waiting": None if load.sample is None else load.sample.waiting,
        }
        return {
            "name": backend.name, "url": backend.url, "pool": backend.pool,
            "group": backend.group, "healthy": health["healthy"], "breaker": health["breaker"],
            "inflight": load.inflight, "last_error": health["last_error"],
            "check_path": health["check_path"], "accept_length": load.accept_length,
            "telemetry": telemetry,
        }

    def live_metrics(self) -> LiveMetrics:
        now = self._clock()
        policy = self._policy.current
        groups = self._clustered(
            self.view.snapshot(now, lambda n: self._health.healthy(n, now)))
        backends = []
        for b in self._backends:
            load = self.view.backends[b.name]
            backends.append(BackendLive(
                name=b.name, pool=b.pool, group=b.group,
                healthy=self._health.healthy(b.name, now),
                breaker=self._health.breaker_state(b.name), inflight=load.inflight,
                engine_load=load.engine_load(now, self.view.poll_interval),
                telemetry_age_s=load.age(now), stale_reads=load.stale_reads,
                accept_length=load.accept_length,
            ))
        return LiveMetrics(
            backends=tuple(backends),
            group_loads={g.name: g.load(policy.load_signal) for g in groups},
            group_pools={g: s.pool for g, s in self._states.items()},
            policy_version=policy.version,
        )


def _other(pool: Pool) -> Pool:
    return POOLS[1] if pool == POOLS[0] else POOLS[0]
