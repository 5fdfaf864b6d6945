"""The load-aware router: EAGLE-3 while a GPU group is lightly loaded, baseline when loaded.

It implements the proxy's `Router` protocol by joining the pure decisions
(`choose_group`, then `pool_choice.decide` with each group's state) to what the
`BackendMonitor` observes, with the policy read once per request. `choose()` does no I/O
and costs O(backends). Only new requests are decided; a request in flight stays on its
backend unless its group switches pools: then it is recalled before its first byte
(`recall`) or handed over after it (`proxy/handover.py`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from specrouter.backends import POOL_HEADER, Backend, Pool, other_pool
from specrouter.config import AdmissionSettings, AffinitySettings
from specrouter.errors import RouterError
from specrouter.observe.loadview import BackendView, GroupView, LoadSignal
from specrouter.routing.affinity.pricing import hold_pool, keep_group_pool, leave_evicting_pool
from specrouter.routing.affinity.tracker import (
    AffinityTracker,
    group_affinity,
    prices_of,
    tracker_of,
)
from specrouter.routing.arrivals import GENERATION_PATHS, Arrival, ArrivalWindow
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.decision import (
    Decision,
    GroupState,
    HeaderError,
    Hints,
    NoHealthyPool,
    parse_pool_header,
)
from specrouter.routing.group_choice import choose_group
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.policy import Policy, PolicySource
from specrouter.routing.pool_choice import decide, fold_accept, follow_group
from specrouter.routing.recall import RecallRegistry
from specrouter.routing.report import BackendLive, LiveMetrics, group_learned, group_report
from specrouter.routing.router import (
    NoBackendAvailable,
    Probe,
    RecallEvent,
    RequestInfo,
    Target,
)
from specrouter.routing.strategies.registry import STRATEGIES

_ARRIVING = "(arriving)"
_NO_HINTS = Hints()  # immutable: one for every request that gives none
#: How old a dry run's decision may be for `choose` to take it (it follows at once).
DRY_RUN_REUSE_S = 1e-3


@dataclass(frozen=True)
class _DryRun:
    """The arrival window's dry-run decision for the least loaded group (`group`),
    decided on `views` with the group's `state` and `policy` at `at`."""

    views: tuple[GroupView, ...]
    group: str
    state: GroupState
    policy: Policy
    at: float
    decision: Decision


class DecisionMetrics(Protocol):
    """The events the router counts (control's `RouterMetrics`)."""

    def observe_decision(self, pool: str, reason: str, group: str) -> None: ...

    def observe_probe(self, backend: str) -> None: ...

    def observe_recall(self, group: str) -> None: ...

    def observe_handover(self, group: str) -> None: ...

    def observe_upstream_error(self, backend: str) -> None: ...

    def observe_affinity(self, hit: bool) -> None: ...


class InvalidPoolHeader(RouterError):
    """A malformed `x-specrouter-pool` header while client overrides are allowed: 400."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, param=POOL_HEADER, code="invalid_pool_header")


class LoadAwareRouter:
    """See the module docstring. Runs on one event loop; not thread-safe."""

    def __init__(
        self,
        monitor: BackendMonitor,
        policy: PolicySource,
        admission: AdmissionSettings | None = None,
        *,
        metrics: DecisionMetrics | None = None,
        cost_models: Mapping[str, GroupCostModel] | None = None,
        rng: random.Random | None = None,
        affinity: AffinitySettings | None = None,
    ) -> None:
        admission = admission if admission is not None else AdmissionSettings()
        self.monitor = monitor
        self._policy = policy
        self._metrics = metrics
        # each group's online cost model, a configured one seeding it
        self._cost_models = monitor.learning.models(cost_models or {}, monitor.clock)
        self._rng = rng if rng is not None else random.Random()
        self._clock = monitor.clock
        self._by_name = {b.name: b for b in monitor.backends}
        self._group_of = {b.name: b.group for b in monitor.backends}
        self._arrivals = ArrivalWindow(admission.arrival_window_ms / 1000.0,
                                       admission.arrival_max_wait_ms / 1000.0,
                                       admission.arrival_memory_s)
        self._baselines = tuple(b.name for b in monitor.backends if b.pool == "baseline")
        self._recall_unstarted = admission.recall_unstarted
        self._handover_tokens = admission.handover_max_tokens
        self._recalls = RecallRegistry()
        # the dry run of the request `settle` let through without a wait, for its `choose`
        self._dry: _DryRun | None = None
        self._states = {g: GroupState() for g in monitor.view.group_names()}
        monitor.on_accept = self._fold_accept
        self._affinity: AffinityTracker | None = None
        if affinity is not None and affinity.enabled:
            self._affinity = tracker_of(affinity, [b.name for b in monitor.backends])
            self._prices = prices_of(affinity)
            self._session_home = affinity.session_home
            monitor.on_capacity = self._affinity.observe_capacity

    # -- the Router protocol ---------------------------------------------------------------

    @property
    def backends(self) -> Sequence[Backend]:
        return self.monitor.backends

    @property
    def policy(self) -> Policy:
        return self._policy.current

    async def settle(self, request: RequestInfo) -> int:
        """The arrival window (`arrivals`) for a generation request the router decides."""
        arrival = self.arrive(request)
        return 0 if arrival is None else await self._arrivals.wait(arrival)

    def arrive(self, request: RequestInfo) -> Arrival | None:
        if (not self._arrivals.enabled or request.pool is not None or request.exclude
                or request.path not in GENERATION_PATHS):
            return None
        policy = self._policy.current
        return self._arrivals.arrive(lambda: self._window_matters(policy))

    async def wait(self, arrival: Arrival) -> int:
        return await self._arrivals.wait(arrival)

    def choose(self, request: RequestInfo) -> Target:
        now = self._clock()
        policy = self._policy.current
        groups = self.monitor.groups(now, request.exclude, sustained=False)
        if (self._arrivals.pending or request.burst_ahead) and request.pool is None:
            groups = self._with_arrivals(groups, request.burst_ahead)
        if request.pool is not None:
            target = self._route_pool(groups, request.pool, policy.load_signal)
        else:
            target = self._decide(groups, policy, request, now)
        trial = self.monitor.health.claim(target.backend.name, now)
        if trial is not None:
            target = replace(target, trial=trial)
        if self._metrics is not None:
            self._metrics.observe_decision(target.pool, target.reason, target.group)
            if request.handed_over:
                self._metrics.observe_handover(target.group)
            elif request.recalled:
                self._metrics.observe_recall(target.group)
        return target

    def acquire(self, target: Target) -> None:
        self.monitor.acquire(id(target), target.backend.name, target.prefill_tokens,
                             target.prompt_tokens, own=target.own)
        self._recalls.track(target)
        if self._affinity is not None:
            self._affinity.begin(target.session)

    def release(self, target: Target) -> None:
        self.monitor.release(id(target), target.backend.name, own=target.own)
        if target.trial is not None:
            self.monitor.health.end_trial(target.backend.name, target.trial)
        self._recalls.forget(target)
        if self._affinity is not None:
            self._affinity.end(target.session)

    def record_outcome(self, backend: str, ok: bool, error: str | None = None) -> None:
        self.monitor.health.record_outcome(backend, ok, error)
        if not ok and self._metrics is not None:
            self._metrics.observe_upstream_error(backend)

    def observe_cached(self, target: Target, prompt_tokens: int, cached_tokens: int) -> None:
        if self._affinity is not None:
            self._affinity.observe_cached(target.backend.name, target.session,
                                          target.predicted_cached, prompt_tokens, cached_tokens)

    def observe_pace(self, target: Target, tpot_ms: float) -> None:
        if self._affinity is not None:
            self._affinity.observe_pace(target.backend.name, tpot_ms)

    def healthy(self, backend: str) -> bool:
        return self.monitor.health.healthy(backend)

    def inflight(self, backend: str) -> int:
        return self.monitor.view.backends[backend].inflight

    async def start(self) -> None:
        await self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()

    # -- decisions -------------------------------------------------------------------------

    def _fold_accept(self, group: str) -> None:
        """Fold a new accept-length reading in now, not at the group's next decision:
        between two requests many readings may arrive, and each must count once."""
        view = self.monitor.group(group, self._clock())
        self._states[group] = fold_accept(self._policy.current, view, self._states[group],
                                          self._cost_models.get(group))

    def _window_matters(self, policy: Policy) -> bool:
        """Whether waiting for the arrival window could change where a request arriving
        now goes: it would go to EAGLE-3 or carry a probe to it (a dry run of `choose`),
        and a plausible burst (`ArrivalWindow.plausible_burst`) counted as load would
        change that. A group without a healthy baseline backend sends everything to
        EAGLE-3 anyway."""
        if policy.mode != "auto":
            return False
        now = self._clock()
        health = self.monitor.health
        if not any(health.healthy(name, now) for name in self._baselines):
            return False
        groups = self.monitor.groups(now, sustained=False)
        models: dict[str, GroupCostModel | None] = {}  # one model build per group
        alone = self._dry_run(policy, self._with_arrivals(groups), now, models)
        if alone is None:
            return False
        first = alone.decision
        if not (first.pool == "eagle" or first.probe_tokens is not None):
            self._dry = alone  # nothing waits: `choose` follows at once
            return False
        burst = self._arrivals.plausible_burst()
        crowded = self._dry_run(policy, self._with_arrivals(groups, burst), now, models)
        if (crowded is None or crowded.decision.pool != first.pool
                or (crowded.decision.probe_tokens is None) != (first.probe_tokens is None)):
            return True
        self._dry = alone
        return False

    def _dry_run(self, policy: Policy, groups: tuple[GroupView, ...], now: float,
                 models: dict[str, GroupCostModel | None]) -> _DryRun | None:
        """The decision for the least loaded live group with a healthy baseline backend,
        not kept; None where there is none. `models` memoises the groups' cost models."""
        live = [g for g in groups if g.any_healthy]
        if not live:
            return None
        group = min(live, key=lambda g: g.load(policy.load_signal))
        if not group.pool_healthy("baseline"):
            return None
        group = self.monitor.with_sustained(group, now)
        if group.name not in models:
            models[group.name] = self._cost_models.get(group.name)
        state = self._states[group.name]
        try:
            decision = decide(policy, group, state, _NO_HINTS, now, models[group.name])
        except NoHealthyPool:
            return None
        return _DryRun(groups, group.name, state, policy, now, decision)

    def _dry_decision(self, views: tuple[GroupView, ...], group: str, policy: Policy,
                      now: float) -> Decision | None:
        """The dry run `settle` just made, when it is the decision `decide` gives this
        request: taken on the same views (no count, reading or health changed), for the
        same group, state and policy, a moment ago. A request the window let through
        reaches `choose` without yielding to another task, so its group is decided once."""
        dry, self._dry = self._dry, None
        if (dry is None or dry.views is not views or dry.group != group
                or dry.state is not self._states[group] or dry.policy is not policy
                or not 0.0 <= now - dry.at <= DRY_RUN_REUSE_S):
            return None
        return dry.decision

    def _with_arrivals(self, groups: tuple[GroupView, ...],
                       expected: int = 0) -> tuple[GroupView, ...]:
        """The requests inside their arrival window (and the `expected` ones of a burst
        still arriving) spread over the live groups, as the group choice will spread
        them, as one extra load entry that no request can be sent to."""
        live = sum(1 for g in groups if g.any_healthy)
        pending_requests = self._arrivals.pending + expected
        if not pending_requests or not live:
            return groups
        share = pending_requests / live
        pending = BackendView(name=_ARRIVING, pool="baseline", healthy=False,
                              inflight=int(share), engine=share, telemetry_age=0.0,
                              stale=False, accept_length=None, accept_seen_at=None)
        return tuple(GroupView(g.name, (*g.backends, pending), g.sustained) for g in groups)

    def _hints(self, policy: Policy, request: RequestInfo) -> Hints:
        if not policy.allow_client_override:
            return _NO_HINTS  # the header is ignored, even a malformed one
        try:
            wanted = parse_pool_header(request.pool_header)
            return _NO_HINTS if wanted is None else Hints(wanted)
        except HeaderError as exc:
            raise InvalidPoolHeader(str(exc)) from None

    def _decide(
        self, groups: tuple[GroupView, ...], policy: Policy, request: RequestInfo, now: float
    ) -> Target:
        lookup = None
        if self._affinity is not None:
            lookup = self._affinity.lookup(request.prefix, request.session)
        affinity = (None if lookup is None
                    else group_affinity(lookup, groups, request.session, self._prices,
                                        self._session_home, self._group_of))
        group = choose_group(groups, policy.load_signal, self._rng, affinity)
        if group is None:
            raise NoBackendAvailable("no healthy backend in any GPU group")
        group = self.monitor.with_sustained(group, now)
        before = self._states[group.name]  # the group's state until this decision's
        hints = self._hints(policy, request)
        decision = (self._dry_decision(groups, group.name, policy, now)
                    if hints is _NO_HINTS else None)
        if decision is None:
            decision = decide(policy, group, before, hints, now,
                              self._cost_models.get(group.name))
        held = lookup.held if lookup is not None else {}
        if request.handed_over:
            decision = follow_group(decision, before)
        elif lookup is not None and decision.reason in STRATEGIES[policy.strategy].reasons:
            decision = keep_group_pool(decision, before.pool, before.since, group, lookup,
                                       self._prices)
            decision = leave_evicting_pool(decision, before.pool, group, lookup,
                                           self._prices, now)
            decision = hold_pool(decision, group, lookup, self._prices)
        recalls = self._recall_unstarted and decision.recalls
        was = before.pool
        if recalls and was != decision.state.pool:
            self._recalls.recall_group(group.name, was, self._handover_tokens)
        self._states[group.name] = decision.state
        if self._affinity is not None and was != decision.state.pool:
            for server in group.servers(decision.state.pool):
                self._affinity.retention.remeasure(server.name)
        recall = (RecallEvent() if recalls and request.stream and not request.recalled
                  and group.pool_healthy(other_pool(decision.pool)) else None)
        backend = self._least_loaded(group.healthy_servers(decision.pool), policy.load_signal,
                                     held)
        if self._affinity is not None and lookup is not None:
            first = not (request.exclude or request.recalled)
            hit = self._affinity.record(request.prefix, request.session, backend.name, lookup,
                                        first)
            if self._metrics is not None and first:
                self._metrics.observe_affinity(hit)
        probe = None
        if decision.probe_tokens is not None:
            eagle = self._least_loaded(group.healthy_servers("eagle"), policy.load_signal)
            probe = Probe(Target(group.name, "eagle", eagle, "goodput_probe", own=True),
                          decision.probe_tokens)
            if self._metrics is not None:
                self._metrics.observe_probe(eagle.name)
        prompt = 0.0 if request.prefix is None else request.prefix.prompt_tokens
        prefill = max(0.0, prompt - held.get(backend.name, 0.0))
        accept = decision.state.accept.ewma if decision.pool == "eagle" else None
        session = request.session if lookup is not None else None
        predicted = 0.0
        if lookup is not None and lookup.predicted and lookup.prompt_tokens > 0:
            predicted = min(1.0, lookup.predicted.get(backend.name, 0.0) / lookup.prompt_tokens)
        return Target(group.name, decision.pool, backend, decision.reason, probe, recall,
                      prefill, prompt, accept, session, predicted)

    def _route_pool(
        self, groups: tuple[GroupView, ...], pool: Pool, signal: LoadSignal
    ) -> Target:
        """A route that needs one pool: its backend in the least loaded group that has
        one, else any healthy backend of the other pool."""
        for wanted, reason in ((pool, "route_pool"), (other_pool(pool), "route_pool_unavailable")):
            candidates = [g for g in groups if g.pool_healthy(wanted)]
            if candidates:
                group = min(candidates, key=lambda g: g.load(signal))
                backend = self._least_loaded(group.healthy_servers(wanted), signal)
                return Target(group.name, wanted, backend, reason)
        raise NoBackendAvailable("no healthy backend in any GPU group")

    def _least_loaded(self, backends: Sequence[BackendView], signal: LoadSignal,
                      held: Mapping[str, float] | None = None) -> Backend:
        """The least loaded of `backends`; with `held`, the one holding most of the
        request's prompt first."""
        if len(backends) == 1:
            return self._by_name[backends[0].name]
        if held:
            best = min(backends, key=lambda b: (-held.get(b.name, 0.0), b.load(signal)))
            return self._by_name[best.name]
        best = min(backends, key=lambda b: b.load(signal))
        return self._by_name[best.name]

    # -- introspection ---------------------------------------------------------------------

    def group_states(self) -> Mapping[str, GroupState]:
        return dict(self._states)

    def details(self) -> dict[str, Any]:
        """For GET /ready: the router, its policy version and every backend."""
        now = self._clock()
        return {
            "router": "load_aware",
            "policy_version": self._policy.current.version,
            "inflight_total": sum(b.inflight for b in self.monitor.view.backends.values()),
            "backends": [self.monitor.describe(b, now) for b in self.backends],
            **self.monitor.cluster_details(),
        }

    def live_view(self) -> dict[str, Any]:
        """For GET /policy: per group its load, the current choice and why (with a cost
        model its predictions); per backend its health, in-flight and telemetry."""
        now = self._clock()
        policy = self._policy.current
        return {
            "groups": [
                group_report(policy, g, self._states[g.name], now, self._cost_models.get(g.name))
                for g in self.monitor.groups(now)
            ],
            "backends": [self.monitor.describe(b, now) for b in self.backends],
            **({} if self._affinity is None else {"affinity": self._affinity.stats()}),
            **self.monitor.cluster_details(),
        }

    def live_metrics(self) -> LiveMetrics:
        now = self._clock()
        policy = self._policy.current
        view, health = self.monitor.view, self.monitor.health
        backends = []
        for b in self.backends:
            load = view.backends[b.name]
            backends.append(BackendLive(
                name=b.name, pool=b.pool, group=b.group, healthy=health.healthy(b.name, now),
                breaker=health.breaker_state(b.name), inflight=load.inflight,
                engine_load=load.engine_load(now, view.poll_interval),
                telemetry_age_s=load.age(now), stale_reads=load.stale_reads,
                accept_length=load.accept_length,
            ))
        return LiveMetrics(
            backends=tuple(backends),
            group_loads={g.name: g.load(policy.load_signal) for g in self.monitor.groups(now)},
            group_pools={g: s.pool for g, s in self._states.items()},
            policy_version=policy.version,
            group_learned={g.name: group_learned(self._cost_models.get(g.name), g.sustained,
                                                 self._states[g.name].accept.ewma)
                           for g in self.monitor.groups(now)},
            cache_retention=({} if self._affinity is None
                             else self._affinity.retention.shares()),
            tpot_within_share=({} if self._affinity is None
                               else self._affinity.tpot_within_shares()),
        )
