"""Routing policy as data, and the pure decisions it drives.

Two levels per request: `choose_group` picks the GPU group, `decide` picks the pool
(EAGLE-3 or baseline) inside it. Both are pure: they read immutable views
(`specrouter.observe.loadview.GroupView`), take the clock and randomness as arguments, and
return new state instead of mutating any. Only new requests are decided; in-flight
requests never move.

Reasons are short stable strings, used as metric labels and in a response header.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specrouter.observe.loadview import GroupView, LoadSignal, Pool
from specrouter.routing.costmodel import GroupCostModel, PoolPrediction, ewma

Mode = Literal["auto", "eagle", "baseline"]
Strategy = Literal["threshold", "overflow", "goodput"]

POOL_HEADER = "x-specrouter-pool"

#: Every reason `decide` can give, for metric label pre-registration and docs.
REASONS: tuple[str, ...] = (
    "client_override", "forced_mode", "eagle_unhealthy", "baseline_unhealthy",
    "below_switch_down", "above_switch_up", "hysteresis_hold_eagle",
    "hysteresis_hold_baseline", "below_eagle_cap", "eagle_cap_reached",
    "goodput_eagle", "goodput_baseline", "goodput_hold_eagle", "goodput_hold_baseline",
    "goodput_dwell_baseline", "goodput_no_model",
)


# EWMA weight of the accept trend whose peak decides whether a probe is worth it. Much
# slower than `accept_smoothing`: one request's readings (40 steps each) scatter by ~0.16
# (seed-coding simulator, 49 readings of one request: 1.73-2.35 around 2.02), and the
# peak of a fast average then sits ~0.3-0.5 above its mean on a steady workload
# (seed-coding sweep with the fast average as the trend: goodput with probes lost 10-18%
# at c=2 and c=8 with every client request on the baseline: the probes were the loss).
ACCEPT_TREND_WEIGHT = 0.1
# A reading averaged over this many requests gets the plain EWMA weights
# (`accept_smoothing`, ACCEPT_TREND_WEIGHT); one over fewer gets less, over more more.
# Without it, readings of a single request (scatter ~0.16) moved the fast average by
# ~0.08 at seed-coding c=1, where EAGLE-3 leads by 10%, i.e. by one accept-length step
# of 0.2: a dip sent a quiet group to the baseline.
ACCEPT_REFERENCE_BATCH = 4
ACCEPT_MAX_BATCH = 16
# SGLang refreshes the snapshot /v1/loads reports every 15 decode steps (and once when
# the engine goes idle), and its accept length is the mean of the last 40 steps: one
# snapshot brings 15 new steps, 15/40 of a reading. The router polls faster than that,
# and a snapshot counted at every poll that saw it made the fast average follow one
# window of one request (seed-coding c=1: a single 40-step window read 1.6 against a mean
# of 2.0 and sent a quiet group to the baseline, 0.906x).
ACCEPT_SNAPSHOT_NEW_STEPS = 15 / 40
# Snapshots it takes to renew the whole 40-step window after a quiet period: the first
# one of a request (prefill: no decode step yet), then one every 15 steps. Until then a
# snapshot still holds steps from before the gap, so the stale average keeps only its
# decayed weight against each of them, not just against the first.
ACCEPT_RENEW_SNAPSHOTS = 4
# Reference readings the trend must hold before its peak counts (about 1 / its weight).
ACCEPT_PEAK_MIN_EVIDENCE = 10.0


class Policy(BaseModel):
    """The routing policy. Server-managed: `version` and `updated_at` (see `apply_put`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(default=1, ge=1)
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    mode: Mode = "auto"
    strategy: Strategy = "threshold"
    load_signal: LoadSignal = "max"
    allow_client_override: bool = False
    # threshold: to baseline when group load >= switch_up, back when <= switch_down
    switch_up: float = Field(default=16.0, gt=0)
    switch_down: float = Field(default=8.0, ge=0)
    # overflow: EAGLE takes new requests up to eagle_cap in flight per healthy EAGLE server
    eagle_cap: int = Field(default=8, ge=1)
    # goodput: switch only when the other pool is predicted better by this fraction...
    goodput_margin: float = Field(default=0.03, ge=0, lt=1)
    # ...and not within min_dwell_s of the last switch of that group
    goodput_min_dwell_s: float = Field(default=1.0, ge=0)
    # EWMA weight of each new accept-length reading (1 = no smoothing)
    accept_smoothing: float = Field(default=0.3, gt=0, le=1)
    # While goodput keeps a group on the baseline and its EAGLE server is idle (so its
    # accept length is a frozen old reading), re-measure it at most every this many
    # seconds with a shadow probe: a copy of the request being routed, cut to
    # `goodput_probe_tokens` output tokens, sent to the EAGLE server and thrown away
    # (the client's request still goes to the baseline). Only when it could matter:
    # the highest accept trend of the last `goodput_probe_memory_s` seconds would put
    # EAGLE-3 ahead at the group's load by `goodput_margin`. 0: never (a workload whose
    # accept length rises again, or a noise dip that moved a quiet group, is then
    # noticed only when the load falls below the crossover at the frozen reading).
    goodput_probe_s: float = Field(default=30.0, ge=0)
    # Long enough that the server's reported accept length is the probe's own (SGLang
    # averages it over the last 40 decode steps: 128 tokens are ~40 steps at accept
    # 3), short enough that the probe costs the shared GPU a few dozen EAGLE steps.
    goodput_probe_tokens: int = Field(default=128, ge=1, le=4096)
    # How long the accept trend's peak is remembered: after this long at a lower accept
    # length the workload is taken to have changed for good and probing stops.
    goodput_probe_memory_s: float = Field(default=600.0, gt=0)

    @field_validator("switch_down")
    @classmethod
    def _down_below_up(cls, v: float, info: ValidationInfo) -> float:
        up = info.data.get("switch_up")
        if up is not None and v >= up:
            raise ValueError(f"switch_down ({v:g}) must be less than switch_up ({up:g})")
        return v

    def public(self) -> dict[str, Any]:
        """JSON-ready form for GET /policy."""
        return self.model_dump(mode="json")


_SERVER_FIELDS = ("version", "updated_at")


def apply_put(current: Policy, body: Mapping[str, Any], now: datetime | None = None) -> Policy:
    """PUT: replace the policy. Raises pydantic.ValidationError (-> 422 with .errors()).

    `version` and `updated_at` in the body are ignored: the server numbers changes.
    """
    fields = {k: v for k, v in body.items() if k not in _SERVER_FIELDS}
    return Policy.model_validate(
        {**fields, "version": current.version + 1, "updated_at": now or datetime.now(UTC)}
    )


def apply_patch(current: Policy, body: Mapping[str, Any], now: datetime | None = None) -> Policy:
    """PATCH: merge `body` into the current policy, validated as a whole."""
    merged = {**current.model_dump(exclude=set(_SERVER_FIELDS)), **body}
    return apply_put(current, merged, now)


# --- per-request inputs and outputs ------------------------------------------------------


class HeaderError(ValueError):
    """A bad x-specrouter-pool value: the router answers 400."""


def parse_pool_header(value: str | None) -> Pool | None:
    if value is None or not value.strip():
        return None
    v = value.strip().lower()
    if v == "eagle":
        return "eagle"
    if v == "baseline":
        return "baseline"
    raise HeaderError(f"{POOL_HEADER} must be 'eagle' or 'baseline', got {value!r}")


@dataclass(frozen=True)
class Hints:
    """What the request itself says; `requested_pool` from `parse_pool_header`."""

    requested_pool: Pool | None = None


@dataclass(frozen=True)
class GroupState:
    """Hysteresis memory of one group; small and immutable so it can be stored anywhere.

    `since` is when `pool` was last switched to (monotonic s); the accept fields hold
    the smoothed EAGLE accept length and the reading time it already includes.
    """

    pool: Pool = "eagle"
    since: float = float("-inf")
    accept_ewma: float | None = None
    accept_seen_at: float | None = None
    probe_at: float = float("-inf")  # last goodput probe sent to an idle EAGLE server
    # the slow accept trend, its highest value within the probe memory and when that was
    accept_trend: float | None = None
    accept_evidence: float = 0.0  # reference readings folded in so far
    # the engine snapshot last folded in (EngineSample.snapshot; for a source that has
    # none, the idle server's accept length)
    accept_last_snapshot: tuple[float, ...] | None = None
    accept_folded_at: float = float("-inf")  # reading time of the last reading folded in
    # after a quiet period: snapshots still to fold against the decayed average, and the
    # time of the last reading before the gap
    accept_renew_left: int = 0
    accept_renew_from: float = float("-inf")
    accept_peak: float | None = None
    accept_peak_at: float = float("-inf")

    def as_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "since": self.since, "accept_ewma": self.accept_ewma,
                "accept_seen_at": self.accept_seen_at, "probe_at": self.probe_at,
                "accept_trend": self.accept_trend, "accept_peak": self.accept_peak}


@dataclass(frozen=True)
class Decision:
    pool: Pool
    reason: str
    state: GroupState
    load: float
    predictions: Mapping[Pool, PoolPrediction] | None = None
    probe: bool = False  # also send a shadow probe to the group's EAGLE server


class NoHealthyPool(RuntimeError):
    """The group has no healthy server; `choose_group` never picks such a group."""


def decide(
    policy: Policy,
    group: GroupView,
    state: GroupState,
    hints: Hints,
    now: float,
    cost_model: GroupCostModel | None = None,
) -> Decision:
    """The pool for one new request in `group`. Store `Decision.state` for the next one."""
    state = smooth_accept(policy, group, state, cost_model)
    load = group.load(policy.load_signal)
    eagle_ok, base_ok = group.pool_healthy("eagle"), group.pool_healthy("baseline")
    if not (eagle_ok or base_ok):
        raise NoHealthyPool(f"group {group.name!r} has no healthy server")

    def fixed(pool: Pool, reason: str) -> Decision:
        return Decision(pool, reason, state, load)

    want = hints.requested_pool if policy.allow_client_override else None
    if want is not None and group.pool_healthy(want):
        return fixed(want, "client_override")
    if not eagle_ok:
        return fixed("baseline", "eagle_unhealthy")
    if not base_ok:
        return fixed("eagle", "baseline_unhealthy")
    if policy.mode != "auto":
        return fixed(policy.mode, "forced_mode")
    if policy.strategy == "overflow":
        return _overflow(policy, group, state, load)
    if policy.strategy == "goodput":
        if cost_model is not None:
            decision = _goodput(policy, state, load, now, cost_model)
            return _probe(policy, group, decision, now, cost_model)
        d = _threshold(policy, state, load, now)
        return replace(d, reason="goodput_no_model")
    return _threshold(policy, state, load, now)


def _switched(state: GroupState, pool: Pool, now: float) -> GroupState:
    return state if state.pool == pool else replace(state, pool=pool, since=now)


def _threshold(policy: Policy, state: GroupState, load: float, now: float) -> Decision:
    if load >= policy.switch_up:
        pool: Pool = "baseline"
        reason = "above_switch_up"
    elif load <= policy.switch_down:
        pool, reason = "eagle", "below_switch_down"
    else:  # inside the band: keep whatever the group is on
        pool, reason = state.pool, f"hysteresis_hold_{state.pool}"
    return Decision(pool, reason, _switched(state, pool, now), load)


def _overflow(policy: Policy, group: GroupView, state: GroupState, load: float) -> Decision:
    eagle_load = sum(b.load(policy.load_signal) for b in group.healthy_servers("eagle"))
    cap = policy.eagle_cap * len(group.healthy_servers("eagle"))
    if eagle_load < cap:
        return Decision("eagle", "below_eagle_cap", replace(state, pool="eagle"), load)
    return Decision("baseline", "eagle_cap_reached", replace(state, pool="baseline"), load)


def smooth_accept(policy: Policy, group: GroupView, state: GroupState,
                  model: GroupCostModel | None = None) -> GroupState:
    """`state` with the group's newest EAGLE accept-length reading folded into its
    averages: the fast one the decisions use (weight `accept_smoothing`) and the slow
    trend whose peak gates probes (ACCEPT_TREND_WEIGHT).

    Each engine snapshot counts once, however many polls and decisions see it, and by
    the new steps and requests behind it (`_reading_evidence`). The fast average starts
    at the cost model's nominal accept length when there is a model, so a lone request's
    first reading, which can be 0.3 off, moves it by its weight instead of replacing it.
    The router calls this on every telemetry reading too, so the average follows the
    server at the poll rate rather than at the request rate (a quiet group must not keep
    a stale average)."""
    accept, seen_at = group.eagle_accept()
    if accept is None or seen_at is None or accept <= 0:
        return state
    if state.accept_seen_at is not None and seen_at <= state.accept_seen_at:
        return state  # this reading is already in the average
    batch = group.eagle_accept_batch()
    idle = batch is not None and batch <= 0
    known = group.eagle_accept_snapshot()
    snapshot = known if known is not None else (accept,) if idle else None
    if snapshot is not None and snapshot == state.accept_last_snapshot:
        # The engine has not refreshed its snapshot since: the same steps again (an idle
        # server repeats its last one at every poll, for as long as it stays idle).
        return replace(state, accept_seen_at=seen_at)
    evidence = _reading_evidence(batch, whole_snapshot=known is not None)
    keep, renew_left, renew_from = _kept_weight(policy, state, seen_at, idle, known is not None)
    trend = ewma(state.accept_trend, accept, _weight(ACCEPT_TREND_WEIGHT, evidence, keep))
    prior = None if model is None else model.nominal_accept_length
    fast = ewma(state.accept_ewma if state.accept_ewma is not None else prior, accept,
                _weight(policy.accept_smoothing, evidence, keep))
    state = replace(state, accept_ewma=fast, accept_seen_at=seen_at, accept_trend=trend,
                    accept_evidence=state.accept_evidence + evidence,
                    accept_last_snapshot=snapshot, accept_folded_at=seen_at,
                    accept_renew_left=renew_left, accept_renew_from=renew_from)
    if state.accept_evidence < ACCEPT_PEAK_MIN_EVIDENCE:
        return state  # the trend is still mostly its first readings: no peak to trust
    if (state.accept_peak is None or trend >= state.accept_peak
            or seen_at - state.accept_peak_at > policy.goodput_probe_memory_s):
        state = replace(state, accept_peak=trend, accept_peak_at=seen_at)
    return state


def _kept_weight(policy: Policy, state: GroupState, seen_at: float, idle: bool,
                 whole_snapshot: bool) -> tuple[float, int, float]:
    """(keep, renew_left, renew_from): how much of its weight the average keeps against
    this reading (`_freshness`), and the renewal after a quiet period
    (ACCEPT_RENEW_SNAPSHOTS) it is in."""
    # Only new steps outweigh a stale average: an idle server's snapshot holds old ones.
    fresh_steps = state.accept_ewma is not None and not idle
    keep = _freshness(policy, seen_at - state.accept_folded_at) if fresh_steps else 1.0
    renew_left, renew_from = state.accept_renew_left, state.accept_renew_from
    if not whole_snapshot or state.accept_ewma is None:
        return keep, renew_left, renew_from
    if renew_left == 0 and fresh_steps and keep < 0.5:
        renew_left, renew_from = ACCEPT_RENEW_SNAPSHOTS, state.accept_folded_at
    if renew_left > 0:  # an idle snapshot now holds the renewed steps too
        return _freshness(policy, seen_at - renew_from), renew_left - 1, renew_from
    return keep, renew_left, renew_from


def _reading_evidence(batch: int | None, whole_snapshot: bool = False) -> float:
    """How many reference readings one reading is worth. Its scatter falls as the
    square root of the requests it averages (one request: ~0.16 over 40 steps), so a
    reading of `batch` requests counts batch / ACCEPT_REFERENCE_BATCH times, up to a
    cap; an idle server's (its last steps, which the last request ran) like one
    request's, once; one without a request count (/server_info) is worth one. A whole
    engine snapshot (its identity known) counts only its new steps
    (ACCEPT_SNAPSHOT_NEW_STEPS)."""
    new_steps = ACCEPT_SNAPSHOT_NEW_STEPS if whole_snapshot else 1.0
    if batch is None:
        return new_steps
    return new_steps * min(max(batch, 1), ACCEPT_MAX_BATCH) / ACCEPT_REFERENCE_BATCH


def _weight(alpha: float, evidence: float, keep: float = 1.0) -> float:
    """The EWMA weight of a reading worth `evidence` reference readings: the weight that
    many reference readings in a row would have together, against an average that kept
    `keep` of its own weight since its last reading (`_freshness`)."""
    new = 1.0 - (1.0 - alpha) ** evidence
    return float(new / (new + keep * (1.0 - new)))


def _freshness(policy: Policy, age_s: float) -> float:
    """How much of its weight an average keeps after `age_s` without a reading. An idle
    EAGLE server is re-measured by a probe every `goodput_probe_s`; by then the average
    holds the workload of a probe period ago, and the probe's few readings (one request
    each) must be able to move it: it decays with a time constant of a quarter period.
    Without probes nothing re-measures it, and it keeps its weight."""
    if policy.goodput_probe_s <= 0:
        return 1.0
    return math.exp(-max(0.0, age_s) / (policy.goodput_probe_s / 4))


def _goodput(
    policy: Policy, state: GroupState, load: float, now: float, model: GroupCostModel
) -> Decision:
    """Send new work to the pool predicted to serve the whole group better at its load.

    The new request joins the group, so the comparison is at load + 1. Switching needs
    the other pool ahead by `goodput_margin`; switching back to EAGLE-3 also needs
    `goodput_min_dwell_s` since the last switch: without both, a load hovering at the
    crossover would flip every request. The dwell is one-sided on purpose: a surge that
    arrives just after the group went back to EAGLE-3 must move to the baseline at once
    (each request kept on EAGLE-3 then slows the whole shared GPU for its lifetime), and
    the margin plus the dwell on the way back already bound the flapping to one round
    trip per dwell period.
    """
    accept = state.accept_ewma if state.accept_ewma is not None else model.nominal_accept_length
    preds = model.predictions(load + 1, accept)
    e, b = preds["eagle"].throughput_tok_s, preds["baseline"].throughput_tok_s
    best: Pool = "eagle" if e >= b else "baseline"
    current = state.pool
    other_ahead = (b > e * (1 + policy.goodput_margin)) if current == "eagle" else (
        e > b * (1 + policy.goodput_margin))
    if best == current:
        return Decision(current, f"goodput_{current}", state, load, preds)
    if not other_ahead:
        return Decision(current, f"goodput_hold_{current}", state, load, preds)
    if best == "eagle" and now - state.since < policy.goodput_min_dwell_s:
        return Decision(current, f"goodput_dwell_{current}", state, load, preds)
    return Decision(best, f"goodput_{best}", _switched(state, best, now), load, preds)


def _probe(policy: Policy, group: GroupView, d: Decision, now: float,
           model: GroupCostModel) -> Decision:
    """Ask for a shadow probe of the idle EAGLE server with this baseline decision when
    its accept length is due to be re-measured (see `Policy.goodput_probe_s`). One at a
    time: the probe itself makes the EAGLE server busy, and its readings are live again.
    A shadow copy instead of the client's own request: the client's request keeps the
    better pool, and the probe's few tokens cost the shared GPU little."""
    if policy.goodput_probe_s <= 0 or d.pool != "baseline" or d.state.pool != "baseline":
        return d
    if now - max(d.state.since, d.state.probe_at) < policy.goodput_probe_s:
        return d
    if any(b.load(policy.load_signal) > 0 for b in group.healthy_servers("eagle")):
        return d
    if not _rebound_would_win(policy, d.state, d.load, model):
        return d
    return replace(d, probe=True, state=replace(d.state, probe_at=now))


def _rebound_would_win(policy: Policy, state: GroupState, load: float,
                       model: GroupCostModel) -> bool:
    """Whether a probe could change anything: back at the accept trend's recent peak,
    EAGLE-3 would be ahead at this load by the margin a switch needs. That holds after
    the workload's accept length fell (1.6 after 3.0: EAGLE-3 would win again if it came
    back), and after a noise dip in the fast average moved a quiet group to the baseline;
    it does not hold for a group on the baseline because it is loaded, whose probes
    would only slow the shared GPU's baseline batch. The margin matters where the pools
    are close: at seed-coding c=2 a peak 0.1 above the mean moved the crossover past the
    load, and probes there cost the level 9%."""
    peak = state.accept_peak
    if peak is None:
        return False
    return model.ratio(load + 1, peak) > 1.0 + policy.goodput_margin


# --- group choice --------------------------------------------------------------------------


def choose_group(
    groups: Sequence[GroupView], signal: LoadSignal, rng: random.Random
) -> GroupView | None:
    """Least-loaded group with a healthy server; None when there is none.

    Up to two candidates: compare all (random among ties). More: power of two choices
    (two distinct random candidates, the less loaded wins, random on a tie), which
    avoids every router replica herding onto the same momentarily-emptiest group.
    """
    live = [g for g in groups if g.any_healthy]
    if not live:
        return None
    if len(live) > 2:
        live = rng.sample(live, 2)
    least = min(g.load(signal) for g in live)
    return rng.choice([g for g in live if g.load(signal) == least])


def group_report(
    policy: Policy,
    group: GroupView,
    state: GroupState,
    now: float,
    cost_model: GroupCostModel | None = None,
) -> dict[str, Any]:
    """The live view of one group for GET /policy: load, what a new request would get
    now and why, and (with a model) both pools' predictions and the crossover.

    Pure and side-effect free: the decision is computed but its state is discarded.
    """
    report: dict[str, Any] = {
        "group": group.name, "load": group.load(policy.load_signal),
        "state": state.as_dict(),
    }
    try:
        d = decide(policy, group, state, Hints(), now, cost_model)
        report.update(choice=d.pool, reason=d.reason)
        accept = d.state.accept_ewma
    except NoHealthyPool:
        report.update(choice=None, reason="no_healthy_server")
        accept = state.accept_ewma
    report["accept_length"] = accept
    if cost_model is not None:
        a = accept if accept is not None else cost_model.nominal_accept_length
        # What the predictions use: the live average, else the model's nominal value.
        report["accept_length_used"] = a
        report["nominal_accept_length"] = cost_model.nominal_accept_length
        preds = cost_model.predictions(report["load"] + 1, a)
        report["predictions"] = {p: v.as_dict() for p, v in preds.items()}
        report["crossover"] = cost_model.crossover(a)
    return report
