"""`threshold`: the group goes to the baseline at `switch_up` and back to EAGLE-3 at
`switch_down`; in between it keeps its pool (hysteresis)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specrouter.backends import Pool
from specrouter.routing.decision import Decision
from specrouter.routing.strategies.base import PolicyParams, Situation


class ThresholdParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    switch_up: float = Field(default=16.0, gt=0)
    switch_down: float = Field(default=8.0, ge=0)

    @field_validator("switch_down")
    @classmethod
    def _down_below_up(cls, v: float, info: ValidationInfo) -> float:
        up = info.data.get("switch_up")
        if up is not None and v >= up:
            raise ValueError(f"switch_down ({v:g}) must be less than switch_up ({up:g})")
        return v


class Threshold:
    name = "threshold"
    params = ThresholdParams
    reasons = ("below_switch_down", "above_switch_up", "hysteresis_hold_eagle",
               "hysteresis_hold_baseline")
    recalls = True

    def decide(self, policy: PolicyParams, at: Situation) -> Decision:
        p = policy.params(ThresholdParams)
        pool: Pool
        if at.load >= p.switch_up:
            pool, reason = "baseline", "above_switch_up"
        elif at.load <= p.switch_down:
            pool, reason = "eagle", "below_switch_down"
        else:
            pool, reason = at.state.pool, f"hysteresis_hold_{at.state.pool}"
        return Decision(pool, reason, at.state.switched(pool, at.now), at.load)
