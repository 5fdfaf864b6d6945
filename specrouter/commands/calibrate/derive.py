"""The policy a sweep recommends: the measured crossover, turned into the chosen strategy's
parameters by the strategy itself (`Strategy.calibrated`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specrouter.commands.calibrate.measure import LevelResult, crossover, ratio
from specrouter.routing.strategies.registry import STRATEGIES


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
    patch: dict[str, Any] = {"mode": "auto", "strategy": strategy,
                             **STRATEGIES[strategy].calibrated(cross, top)}
    return Recommendation(cross, strategy, patch, better)
