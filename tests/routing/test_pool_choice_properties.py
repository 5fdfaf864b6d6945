"""Invariants of the threshold hysteresis over random load sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specrouter.routing.decision import GroupState, Hints
from specrouter.routing.policy import Policy
from specrouter.routing.pool_choice import decide
from tests.routing.helpers import group

POLICY = Policy(strategy="threshold", switch_up=20, switch_down=10, load_signal="inflight")


@settings(deadline=None)  # no per-example deadline: 2 shared cores make timing noisy
@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=60))
def test_threshold_band_keeps_previous_pool(loads: list[int]) -> None:
    state, previous = GroupState(), "eagle"
    for t, load in enumerate(loads):
        d = decide(POLICY, group(eagle=load), state, Hints(), float(t))
        if load >= POLICY.switch_up:
            assert d.pool == "baseline"
        elif load <= POLICY.switch_down:
            assert d.pool == "eagle"
        else:
            assert d.pool == previous
        state, previous = d.state, d.pool
