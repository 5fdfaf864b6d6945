"""The `online` strategy: sustained load, Little's law and the burst path (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specrouter.routing.costmodel import GroupCostModel, PolyCurve, TableCurve
from specrouter.routing.decision import GroupState, Hints
from specrouter.routing.policy import Policy
from specrouter.routing.pool_choice import decide
from specrouter.routing.strategies.online import (
    LOAD_TOLERANCE,
    drain_cost,
    gain,
    matching_load,
    wait_cost,
)
from tests.routing.helpers import group

# seed-coding-like lines (crossover 2.7 at accept 2.0) and H200-like (crossover ~44 at 2.5)
SEED = GroupCostModel(PolyCurve(20.0, 0.87), PolyCurve(33.0, 4.33), 2.0, 256, 48)
H200 = GroupCostModel(PolyCurve(5.1, 0.066), PolyCurve(6.5, 0.33), 2.5, 256, 48)
# a long-prompt workload where the baseline leads at every load (seed-coding at ctx 1200)
LONG = GroupCostModel(PolyCurve(20.0, 0.87), PolyCurve(45.0, 4.33), 2.0, 256, 48)
POLICY = Policy(strategy="online")


def pick(model: GroupCostModel, load: int, sustained: float | None, pool: str = "eagle",
         now: float = 100.0, since: float = 0.0, other: int = 0) -> tuple[str, str]:
    g = replace(group(eagle=load if pool == "eagle" else other,
                      base=load if pool == "baseline" else other), sustained=sustained)
    state = GroupState(pool, since)  # type: ignore[arg-type]
    d = decide(POLICY, g, state, Hints(), now, model)
    return d.pool, d.reason


def test_gain_is_littles_law_at_the_same_demand() -> None:
    # on EAGLE-3 at 1 request the baseline is slower per token: negative gain
    assert gain(SEED, "eagle", 1.0, 2.0) < 0
    # at a sustained 8 the baseline carries the same tokens at a lower load, faster
    assert gain(SEED, "eagle", 8.0, 2.0) > 0.2
    assert gain(H200, "eagle", 8.0, 2.5) < 0 < gain(H200, "eagle", 80.0, 2.5)


def test_short_overlaps_stay_on_the_active_pool() -> None:
    # two requests overlap now, the group's sustained load is 0.6: EAGLE-3 keeps them
    assert pick(SEED, 1, 0.6) == ("eagle", "online_eagle")
    # the same instant at a sustained load of 6 moves the group
    assert pick(SEED, 1, 6.0) == ("baseline", "online_baseline")


def test_a_burst_beyond_eagle_moves_at_once() -> None:
    assert pick(SEED, 12, 0.5) == ("baseline", "online_burst")  # far past the crossover
    # H200: below the crossover a burst stays; past EAGLE-3's batch cap (48) the extra
    # requests queue there and the baseline serves the whole load better
    assert pick(H200, 30, 2.0) == ("eagle", "online_eagle")
    assert pick(H200, 60, 2.0) == ("baseline", "online_burst")


def test_back_to_eagle_after_the_dwell_and_only_when_sustained_load_falls() -> None:
    assert pick(SEED, 0, 6.0, pool="baseline") == ("baseline", "online_baseline")
    assert pick(SEED, 0, 0.5, pool="baseline", now=1.0, since=0.0) == (
        "baseline", "online_dwell_baseline")
    assert pick(SEED, 0, 0.5, pool="baseline", now=10.0, since=0.0) == ("eagle", "online_eagle")


# seed-coding-like step tables: piecewise linear, EAGLE-3 capped at 48
TABLES = GroupCostModel(
    TableCurve(((1, 20.9), (4, 24.0), (8, 28.5), (16, 37.0), (32, 54.8), (64, 90.0),
                (128, 160.0), (256, 300.0))),
    TableCurve(((1, 38.5), (4, 55.0), (8, 77.6), (16, 120.0), (32, 211.0), (48, 300.0))),
    2.0, 256, 48)


def least_load(model: GroupCostModel, pool: str, demand: float, accept: float) -> float:
    """The least load carrying `demand`, by 60 halvings of [0, 4096]."""
    lo, hi = 0.0, 4096.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if model.predict(pool, mid, accept).throughput_tok_s < demand:  # type: ignore[arg-type]
            lo = mid
        else:
            hi = mid
    return max(1.0, hi)


@pytest.mark.parametrize("model", [SEED, H200, LONG, TABLES])
@pytest.mark.parametrize("pool", ["eagle", "baseline"])
def test_the_matching_load_is_the_least_load_that_carries_the_demand(
        model: GroupCostModel, pool: str) -> None:
    cap = model.eagle_max_batch if pool == "eagle" else model.baseline_max_batch
    assert cap is not None
    for accept in (1.0, 2.0, 4.5):
        top = model.predict(pool, cap, accept).throughput_tok_s  # type: ignore[arg-type]
        # from below one request's throughput up to the capped batch's (where it flattens)
        for share in (0.01, 0.2, 0.5, 0.9, 0.999, 1.0):
            demand = share * top
            found = matching_load(model, pool, demand, accept)  # type: ignore[arg-type]
            exact = least_load(model, pool, demand, accept)
            assert found == pytest.approx(exact, rel=2 * LOAD_TOLERANCE, abs=1e-9)
            assert model.predict(pool, found, accept).throughput_tok_s >= (  # type: ignore[arg-type]
                demand * (1 - 1e-12))


def test_without_a_model_it_decides_as_threshold() -> None:
    d = decide(POLICY, group(eagle=20), GroupState(), Hints(), 0.0, None)
    assert (d.pool, d.reason) == ("baseline", "online_no_model")


@pytest.mark.parametrize("sustained", [0.0, 0.5, 3.0, 30.0, 300.0])
def test_h200_stays_on_eagle_below_its_crossover(sustained: float) -> None:
    pool, _ = pick(H200, 0, sustained)
    assert pool == ("eagle" if sustained < 40 else "baseline")


def test_a_light_load_switch_waits_until_the_current_pool_is_idle() -> None:
    assert 0 < gain(LONG, "eagle", 1.0, 2.0) < 0.25  # not a burst
    # one request still decoding on EAGLE-3: switching now would drain it next to the
    # baseline's, both engines' steps in every round
    assert pick(LONG, 1, 1.0) == ("eagle", "online_drain_eagle")
    # EAGLE-3 idle (the baseline's own requests do not hold it back): the group moves
    assert pick(LONG, 0, 1.0, other=1) == ("baseline", "online_baseline")
    # the same back to EAGLE-3 after the dwell
    assert pick(SEED, 1, 0.5, pool="baseline", now=10.0) == ("baseline", "online_drain_baseline")
    # at a sustained 6 the wait for an idle EAGLE-3 (e^6 / 6 request durations) costs
    # more than a drain: the group moves at once
    assert pick(LONG, 1, 6.0) == ("baseline", "online_baseline")
    # the drain's price scales with the steps of the requests held
    assert drain_cost(LONG, "eagle", 4) > drain_cost(LONG, "eagle", 1) > 0 == drain_cost(
        LONG, "eagle", 0)
    assert wait_cost(0.2, 6.0) > 10 * wait_cost(0.2, 1.0)


def test_the_transition_cost_can_be_switched_off() -> None:
    policy = Policy(strategy="online", online_transition_cost=0.0)
    g = replace(group(eagle=1), sustained=1.0)
    d = decide(policy, g, GroupState("eagle", 0.0), Hints(), 100.0, LONG)
    assert (d.pool, d.reason) == ("baseline", "online_baseline")
