"""The policy a sweep recommends, per strategy.

- threshold: the router decides when a request arrives, and under a closed loop of C
  clients C - 1 requests are then already in the group, so the group load that switches
  to the baseline is `crossover - 1` (`switch_up`); `switch_down` sits a band below it (at
  least one request wide) so a load wobbling by one request does not flap;
- overflow: EAGLE-3 keeps up to floor(crossover) requests in flight (`eagle_cap`);
- goodput: the threshold band too (a group the router has no cost model for falls back
  to it), the cost model itself comes from `fit.fit_model`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specrouter.commands.calibrate.measure import LevelResult, crossover, ratio


@dataclass(frozen=True)
class Recommendation:
    crossover: float | None  # concurrency where the baseline catches up; None: never
    strategy: str
    patch: dict[str, Any]
    better: dict[int, str]  # per level, the pool with the higher output throughput


def recommend(results: Mapping[str, Sequence[LevelResult]], strategy: str) -> Recommendation:
    eagle, baseline = results["eagle"], results["baseline"]
    cross = crossover(eagle, baseline)
    better = {e.concurrency: ("eagle" if ratio(e, b) > 1.0 else "baseline")
              for e, b in zip(eagle, baseline, strict=True)}
    top = max(e.concurrency for e in eagle)
    patch: dict[str, Any] = {"mode": "auto", "strategy": strategy}
    if strategy == "overflow":
        cap = top * 4 if cross is None else max(1, math.floor(cross))
        patch["eagle_cap"] = cap
    else:
        up, down = thresholds(cross, top)
        patch.update(switch_up=up, switch_down=down)
    return Recommendation(cross, strategy, patch, better)


def thresholds(cross: float | None, top_level: int) -> tuple[float, float]:
    """(switch_up, switch_down) in group-load units (requests in the group when a new one
    arrives, i.e. concurrency - 1 under a closed loop). EAGLE-3 ahead at every measured
    level switches only well beyond them."""
    up = float(top_level * 2) if cross is None else max(0.5, cross - 1.0)
    down = max(0.0, up - max(1.0, 0.25 * up))
    return round(up, 2), round(down, 2)
