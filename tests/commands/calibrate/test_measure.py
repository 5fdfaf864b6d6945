"""Calibration measurements: the level's throughput and the crossover (with the thresholds
derived from it)."""

from __future__ import annotations

import pytest

from specrouter.commands.calibrate.measure import LevelResult, crossover
from specrouter.routing.strategies.threshold import Threshold


def test_throughput_counts_only_tokens_decoded_inside_the_window() -> None:
    level = LevelResult("eagle", 2, window=(0.0, 10.0))
    level.spans += [(0.0, 10.0, 100),  # wholly inside
                    (5.0, 15.0, 100),  # half inside: the tail after the deadline is not C
                    (10.0, 12.0, 50)]  # started at the deadline: nothing inside
    level.output_tokens, level.wall_s = 250, 15.0
    assert level.throughput_tok_s == pytest.approx(15.0)


def test_throughput_without_a_window_is_tokens_over_wall_time() -> None:
    level = LevelResult("baseline", 1, output_tokens=300, wall_s=3.0)
    level.spans.append((0.0, 3.0, 300))
    assert level.throughput_tok_s == pytest.approx(100.0)


def _levels(pool: str, rates: dict[int, float]) -> list[LevelResult]:
    return [LevelResult(pool, c, output_tokens=int(r * 10), wall_s=10.0)
            for c, r in rates.items()]


def test_crossover_interpolates_the_throughput_ratio_between_levels() -> None:
    eagle = _levels("eagle", {16: 1200, 32: 1100, 64: 1000})
    baseline = _levels("baseline", {16: 1000, 32: 1000, 64: 1250})
    # ratio 1.1 at 32 and 0.8 at 64: 1.0 a third of the way
    assert crossover(eagle, baseline) == pytest.approx(32 + 32 / 3, abs=0.01)
    band = Threshold().calibrated(crossover(eagle, baseline), 64)
    up, down = band["switch_up"], band["switch_down"]
    assert up == pytest.approx(41.67, abs=0.01) and down == pytest.approx(31.25, abs=0.01)
