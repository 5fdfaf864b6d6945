"""What the router reports: the live view of a group in GET /policy, and the gauges read at
each /metrics scrape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specrouter.observe.loadview import GroupView
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.decision import GroupState, Hints, NoHealthyPool
from specrouter.routing.online import LearnedCostModel
from specrouter.routing.policy import Policy
from specrouter.routing.pool_choice import decide


def group_report(
    policy: Policy,
    group: GroupView,
    state: GroupState,
    now: float,
    cost_model: GroupCostModel | None = None,
) -> dict[str, Any]:
    """Load (instant and sustained), what a new request would get now and why, and (with
    a cost model) both pools' predictions and the crossover; with a learned model what
    it learned. The decision's new state is discarded."""
    report: dict[str, Any] = {
        "group": group.name, "load": group.load(policy.load_signal),
        "state": state.as_dict(),
    }
    try:
        d = decide(policy, group, state, Hints(), now, cost_model)
        report.update(choice=d.pool, reason=d.reason)
        accept = d.state.accept.ewma
    except NoHealthyPool:
        report.update(choice=None, reason="no_healthy_server")
        accept = state.accept.ewma
    report["accept_length"] = accept
    if cost_model is not None:
        # the predictions use the live average, else the model's nominal accept length
        used = accept if accept is not None else cost_model.nominal_accept_length
        report["accept_length_used"] = used
        report["nominal_accept_length"] = cost_model.nominal_accept_length
        preds = cost_model.predictions(report["load"] + 1, used)
        report["predictions"] = {p: v.as_dict() for p, v in preds.items()}
        report["crossover"] = cost_model.crossover(used)
        if isinstance(cost_model, LearnedCostModel):
            report["learned"] = cost_model.describe(used)
    report["sustained_load"] = group.sustained
    return report


@dataclass(frozen=True)
class BackendLive:
    name: str
    pool: str
    group: str
    healthy: bool
    breaker: str
    inflight: int
    engine_load: float | None
    telemetry_age_s: float | None
    stale_reads: int
    accept_length: float | None


#: Batch sizes at which /metrics shows each learned step curve.
METRIC_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class GroupLearned:
    """What /metrics shows of a group's online model and sustained load."""

    sustained_load: float | None
    crossover: float | None
    step_ms: Mapping[str, Mapping[int, float]]  # pool -> batch -> ms
    prior_share: Mapping[str, float]  # pool -> share of the fit still the prior
    probes: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (pool, outcome)


def group_learned(model: GroupCostModel | None, sustained: float | None,
                  accept: float | None) -> GroupLearned:
    if model is None:
        return GroupLearned(sustained, None, {}, {})
    used = accept if accept is not None else model.nominal_accept_length
    steps = {"eagle": {b: model.eagle.ms(b) for b in METRIC_BATCHES},
             "baseline": {b: model.baseline.ms(b) for b in METRIC_BATCHES}}
    learned = model if isinstance(model, LearnedCostModel) else None
    prior: dict[str, float] = ({} if learned is None else
                               {p: v.prior_share for p, v in learned.pools.items()})
    probes: dict[tuple[str, str], int] = ({} if learned is None else
                                          {(p, o): n for (p, o), n in learned.probes.items()})
    return GroupLearned(sustained, model.crossover(used), steps, prior, probes)


@dataclass(frozen=True)
class LiveMetrics:
    """What the router reports at scrape time."""

    backends: tuple[BackendLive, ...] = ()
    group_loads: Mapping[str, float] = field(default_factory=dict)
    group_pools: Mapping[str, str] = field(default_factory=dict)
    policy_version: int = 0
    group_learned: Mapping[str, GroupLearned] = field(default_factory=dict)
    # per backend the share of the affinity index's prediction its cache holds, from the
    # engine's reports of cached tokens (routing/affinity/retention.py)
    cache_retention: Mapping[str, float] = field(default_factory=dict)
    # with a TPOT objective, per backend the share of its recent streamed answers within
    # it (routing/affinity/objective.py)
    tpot_within_share: Mapping[str, float] = field(default_factory=dict)
