"""`overflow`: EAGLE-3 takes new requests while it has fewer than `eagle_cap` in flight
per healthy EAGLE-3 backend; the rest go to the baseline. Requests already admitted to
EAGLE-3 are within the cap and stay there."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specrouter.routing.decision import Decision
from specrouter.routing.strategies.base import PolicyParams, Situation


class OverflowParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    eagle_cap: int = Field(default=8, ge=1)


class Overflow:
    name = "overflow"
    params = OverflowParams
    reasons = ("below_eagle_cap", "eagle_cap_reached")
    recalls = False
    uses_cost_model = False

    def calibrated(self, crossover: float | None, top_level: int) -> dict[str, Any]:
        """EAGLE-3 keeps up to floor(crossover) requests in flight."""
        return {"eagle_cap": top_level * 4 if crossover is None else max(1, math.floor(crossover))}

    def decide(self, policy: PolicyParams, at: Situation) -> Decision:
        eagles = at.group.healthy_servers("eagle")
        eagle_load = sum(b.load(policy.load_signal) for b in eagles)
        if eagle_load < policy.params(OverflowParams).eagle_cap * len(eagles):
            return Decision("eagle", "below_eagle_cap", replace(at.state, pool="eagle"), at.load)
        return Decision("baseline", "eagle_cap_reached", replace(at.state, pool="baseline"),
                        at.load)
