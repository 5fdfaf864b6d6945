"""`online`: the group's pool follows its sustained load, priced by the online cost model.

The model (`routing/online.py`) is learned from the group's own telemetry, so no
calibration is needed; a configured cost model seeds it. The decision reads the group's
sustained load S (a time-weighted average, `routing/learning.py`), not the instantaneous
count: a light open-loop load that overlaps two requests now and then keeps its pool,
since sending the overlap to the other server would run both servers of the shared GPU
at once, each round then costing both engines' steps.

By Little's law the current pool at S carries a demand of lambda = S x (tokens per
request per ms). The other pool would carry the same demand at the load L' where its
throughput equals lambda; the group switches when the other pool's time per output token
at L' beats the current pool's at S by `online_margin` (a switch back to EAGLE-3 also
waits `online_min_dwell_s` since the last switch). A burst that clearly exceeds EAGLE-3
moves at once: the baseline ahead at the instantaneous load by `online_burst_margin`
(the prediction counts the requests beyond EAGLE-3's batch cap as queued, so a load past
the cap moves only when the baseline serves it better).

A switch has a transition cost: the requests left on the old pool drain next to the new
pool's, and while both engines of the shared GPU have work every round costs both
engines' steps (`sim/gpu.py`), so for about one request's duration every new request
runs (old step at the held load + new step) / new step slower, times the learned mixing
ratio (`drain_cost`). Waiting instead until a decision finds the old pool idle costs the
gain on every arrival of the busy period: (e^S - 1) / S request durations at a sustained
load S (`wait_cost`). A switch waits (`online_drain_*`) while the drain costs more; at
light load the old pool is idle every few arrivals, past a sustained load of ~4 the wait
grows as e^S and the switch goes at once.

Without a cost model it decides as `threshold` (reason `online_no_model`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specrouter.backends import Pool, other_pool
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.decision import Decision
from specrouter.routing.online import LearnedCostModel
from specrouter.routing.strategies.base import PolicyParams, Situation
from specrouter.routing.strategies.threshold import Threshold

#: Loads searched for the other pool's matching load.
MAX_LOAD = 4096.0
#: The matching load is found to this share of itself: the other pool's time per token
#: there is off by less than that share, far inside any margin a decision compares with.
LOAD_TOLERANCE = 1e-4
#: A bound on that search's steps, far above what it takes.
MAX_STEPS = 64


class OnlineParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # a switch on sustained load needs the other pool's time per token lower by this share
    online_margin: float = Field(default=0.05, ge=0, lt=1)
    # a burst moves EAGLE-3's group at once when the baseline leads at the instantaneous
    # load by this share
    online_burst_margin: float = Field(default=0.25, ge=0, lt=1)
    # a switch back to EAGLE-3 comes at least this long after the group's last switch
    online_min_dwell_s: float = Field(default=2.0, ge=0)
    # weight of a switch's transition cost (the drain next to the other pool) against
    # the wait for the current pool to idle; 0: switches never wait
    online_transition_cost: float = Field(default=1.0, ge=0)


def matching_load(model: GroupCostModel, pool: Pool, demand: float, accept: float) -> float:
    """The least load (at least 1, to LOAD_TOLERANCE of itself) at which `pool` carries
    `demand` tokens per second; the caller checks that it does at MAX_LOAD. Throughput
    grows with load up to the batch cap and stays there: a bracket by doubling, then
    regula falsi with the Illinois step (the end that stays put has its value halved),
    which converges in about seven evaluations where bisection from the bracket takes
    fourteen; a decision searches twice per request and the proxy decides up to three
    times per request (`LoadAwareRouter.settle`)."""
    def excess(load: float) -> float:
        return model.throughput_tok_s(pool, load, accept) - demand

    lo, f_lo = 1.0, excess(1.0)
    if f_lo >= 0:
        return 1.0
    hi, f_hi = lo, f_lo
    while f_hi < 0 and hi < MAX_LOAD:
        lo, f_lo = hi, f_hi
        hi = min(2.0 * hi, MAX_LOAD)
        f_hi = excess(hi)
    kept = 0  # which end the last step kept: 1 the low one, -1 the high one
    for _ in range(MAX_STEPS):
        if hi - lo <= LOAD_TOLERANCE * hi:
            break
        x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        if not lo < x < hi:  # the high end already carries the demand exactly (past the
            x = 0.5 * (lo + hi)  # batch cap every load does): halve towards the least
        f_x = excess(x)
        if f_x >= 0:
            hi, f_hi = x, f_x
            f_lo = 0.5 * f_lo if kept == 1 else f_lo
            kept = 1
        else:
            lo, f_lo = x, f_x
            f_hi = 0.5 * f_hi if kept == -1 else f_hi
            kept = -1
    return hi


def gain(model: GroupCostModel, pool: Pool, load: float, accept: float) -> float:
    """The share of time per output token the other pool saves over `pool` at the demand
    `pool` carries at `load` (negative: `pool` is better; -1: the other pool cannot
    carry the demand)."""
    here = model.predict(pool, load, accept)
    demand = here.throughput_tok_s
    other = other_pool(pool)
    if model.throughput_tok_s(other, MAX_LOAD, accept) < demand:
        return -1.0
    there = model.predict(other, matching_load(model, other, demand, accept), accept)
    return 1.0 - there.tpot_ms / here.tpot_ms


def in_flight(at: Situation, pool: Pool, policy: PolicyParams) -> float:
    """The group's load on `pool`'s servers under the policy's signal."""
    return sum(b.load(policy.load_signal) for b in at.group.servers(pool))


def drain_cost(model: GroupCostModel, pool: Pool, held: float) -> float:
    """What a switch away from `pool` now costs, in request durations of the other pool:
    while the `held` requests drain (about one request's duration), every round of the
    other pool also waits for a step of `pool` at `held`, times the learned mixing ratio
    (1 until measured). 0 when `pool` holds nothing."""
    if held <= 0:
        return 0.0
    mixing = (model.mixing_ratio or 1.0) if isinstance(model, LearnedCostModel) else 1.0
    return mixing * model.curve(pool).ms(held) / model.curve(other_pool(pool)).ms(1.0)


def wait_cost(gain_share: float, sustained: float) -> float:
    """What waiting for `pool` to idle costs, in request durations: the expected busy
    period of a Poisson load of `sustained` requests in flight, (e^S - 1) / lambda, is
    (e^S - 1) / S request durations, each arrival meanwhile paying `gain_share` more."""
    s = max(sustained, 1e-6)
    return gain_share * math.expm1(min(s, 50.0)) / s


class Online:
    name = "online"
    params = OnlineParams
    reasons = ("online_eagle", "online_baseline", "online_hold_eagle", "online_hold_baseline",
               "online_dwell_baseline", "online_drain_eagle", "online_drain_baseline",
               "online_burst", "online_no_model")
    recalls = True
    uses_cost_model = True

    def calibrated(self, crossover: float | None, top_level: int) -> dict[str, Any]:
        """Nothing to set: a calibration seeds the cost model instead."""
        return {}

    def decide(self, policy: PolicyParams, at: Situation) -> Decision:
        model = at.cost_model
        if model is None:
            return replace(Threshold().decide(policy, at), reason="online_no_model")
        p = policy.params(OnlineParams)
        state = at.state
        accept = state.accept.ewma if state.accept.ewma is not None else (
            model.nominal_accept_length)
        current = state.pool
        preds = model.predictions(at.load + 1, accept)
        if current == "eagle" and gain(model, "eagle", at.load + 1,
                                       accept) > p.online_burst_margin:
            return Decision("baseline", "online_burst",
                                state.switched("baseline", at.now), at.load, preds)
        sustained = at.load if at.sustained is None else at.sustained
        g = gain(model, current, sustained + 1.0, accept)
        if g <= 0:
            return Decision(current, f"online_{current}", state, at.load, preds)
        if g <= p.online_margin:
            return Decision(current, f"online_hold_{current}", state, at.load, preds)
        best = other_pool(current)
        if best == "eagle" and at.now - state.since < p.online_min_dwell_s:
            return Decision(current, f"online_dwell_{current}", state, at.load, preds)
        held = in_flight(at, current, policy)
        if p.online_transition_cost * drain_cost(model, current, held) > wait_cost(g, sustained):
            return Decision(current, f"online_drain_{current}", state, at.load, preds)
        return Decision(best, f"online_{best}", state.switched(best, at.now), at.load, preds)
