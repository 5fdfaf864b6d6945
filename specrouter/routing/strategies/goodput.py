"""`goodput`: new work goes to the pool that the group's cost model predicts to serve the
whole group better at its load, with the live accept length; while the group sits on
the baseline, an idle EAGLE-3 backend is re-measured by a shadow probe.

Without a cost model for the group it decides as `threshold`, with reason
`goodput_no_model`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specrouter.backends import Pool
from specrouter.routing.accept import AcceptParams
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.decision import Decision, GroupState
from specrouter.routing.strategies.base import PolicyParams, Situation
from specrouter.routing.strategies.threshold import Threshold


class GoodputParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # a switch needs the other pool predicted better by this fraction...
    goodput_margin: float = Field(default=0.03, ge=0, lt=1)
    # ...and a switch back to EAGLE-3 this long since the group's last switch
    goodput_min_dwell_s: float = Field(default=1.0, ge=0)
    # output tokens of a shadow probe: enough for the backend's reported accept length
    # (a mean over its last 40 decode steps) to be the probe's own
    goodput_probe_tokens: int = Field(default=128, ge=1, le=4096)


class Goodput:
    name = "goodput"
    params = GoodputParams
    reasons = ("goodput_eagle", "goodput_baseline", "goodput_hold_eagle",
               "goodput_hold_baseline", "goodput_dwell_baseline", "goodput_no_model")
    recalls = True
    uses_cost_model = True

    def calibrated(self, crossover: float | None, top_level: int) -> dict[str, Any]:
        """The threshold band, which a group without a cost model falls back to."""
        return Threshold().calibrated(crossover, top_level)

    def decide(self, policy: PolicyParams, at: Situation) -> Decision:
        if at.cost_model is None:
            return replace(Threshold().decide(policy, at), reason="goodput_no_model")
        params = policy.params(GoodputParams)
        decision = _by_goodput(params, at, at.cost_model)
        return _with_probe(params, policy, at, decision, at.cost_model)


def _by_goodput(params: GoodputParams, at: Situation, model: GroupCostModel) -> Decision:
    """Compare both pools at load + 1 (the new request joins the group).

    Switching needs the other pool ahead by the margin; switching back to EAGLE-3 also
    needs the dwell, so a load hovering at the crossover flips at most once per dwell
    period. The dwell is one-sided: a surge right after a switch to EAGLE-3 moves to the
    baseline at once, since each request kept on EAGLE-3 slows the shared GPU for its
    whole life.
    """
    state = at.state
    accept = state.accept.ewma if state.accept.ewma is not None else model.nominal_accept_length
    preds = model.predictions(at.load + 1, accept)
    e, b = preds["eagle"].throughput_tok_s, preds["baseline"].throughput_tok_s
    best: Pool = "eagle" if e >= b else "baseline"
    current = state.pool
    ahead = b > e * (1 + params.goodput_margin) if current == "eagle" else (
        e > b * (1 + params.goodput_margin))
    if best == current:
        return Decision(current, f"goodput_{current}", state, at.load, preds)
    if not ahead:
        return Decision(current, f"goodput_hold_{current}", state, at.load, preds)
    if best == "eagle" and at.now - state.since < params.goodput_min_dwell_s:
        return Decision(current, f"goodput_dwell_{current}", state, at.load, preds)
    return Decision(best, f"goodput_{best}", state.switched(best, at.now), at.load, preds)


def _with_probe(params: GoodputParams, policy: PolicyParams, at: Situation, d: Decision,
                model: GroupCostModel) -> Decision:
    """`d` with a shadow probe of the idle EAGLE-3 backend when its accept length is due
    to be re-measured (`goodput_probe_s`) and a rebound could change the choice. One at
    a time: the probe makes the backend busy, and its readings are live again."""
    accept = policy.params(AcceptParams)
    if accept.goodput_probe_s <= 0 or d.pool != "baseline" or d.state.pool != "baseline":
        return d
    if at.now - max(d.state.since, d.state.probe_at) < accept.goodput_probe_s:
        return d
    if any(b.load(policy.load_signal) > 0 for b in at.group.healthy_servers("eagle")):
        return d
    if not _rebound_would_win(params, d.state, d.load, model):
        return d
    return replace(d, probe_tokens=params.goodput_probe_tokens,
                   state=replace(d.state, probe_at=at.now))


def _rebound_would_win(params: GoodputParams, state: GroupState, load: float,
                       model: GroupCostModel) -> bool:
    """Whether EAGLE-3, back at the accept trend's recent peak, would lead at this load
    by the margin a switch needs. True after the workload's accept length fell, or after
    a noise dip moved a quiet group; false for a group on the baseline because it is
    loaded, whose probes would only slow the shared GPU."""
    peak = state.accept.peak
    if peak is None:
        return False
    return model.ratio(load + 1, peak) > 1.0 + params.goodput_margin
