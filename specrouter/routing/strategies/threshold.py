"""`threshold`: the group goes to the baseline at `switch_up` and back to EAGLE-3 at
`switch_down`; in between it keeps its pool (hysteresis)."""

from __future__ import annotations

from typing import Any

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
    uses_cost_model = False

    def calibrated(self, crossover: float | None, top_level: int) -> dict[str, Any]:
        """The router decides when a request arrives, and under a closed loop of C clients
        C - 1 requests are then already in the group, so the load that switches to the
        baseline is `crossover - 1`; `switch_down` sits a band below it (at least one
        request wide) so a load wobbling by one request does not flap. EAGLE-3 ahead at
        every measured level switches only well beyond them."""
        up = float(top_level * 2) if crossover is None else max(0.5, crossover - 1.0)
        down = max(0.0, up - max(1.0, 0.25 * up))
        return {"switch_up": round(up, 2), "switch_down": round(down, 2)}

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
