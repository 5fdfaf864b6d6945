"""Invariants of the threshold hysteresis and the credit rule over random sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specrouter.observe.loadview import EngineSample, LoadView
from specrouter.routing.policy import GroupState, Hints, Policy, decide
from tests.unit.helpers import group

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


@settings(deadline=None)
@given(st.lists(st.sampled_from(["acquire", "release", "publish"]), max_size=80),
       st.integers(min_value=0, max_value=5))
def test_credit_rule_equals_engine_truth(ops: list[str], others: int) -> None:
    """If the engine counted exactly our in-flight plus `others` at each sample, the
    credited engine load always equals our in-flight plus `others`."""
    lv = LoadView(poll_interval=1.0)
    lv.add_backend("b", "g", "baseline")
    t = 0.0
    for op in ops:
        t += 0.01
        ours = lv.backends["b"].inflight
        if op == "acquire":
            lv.acquire("b")
        elif op == "release" and ours > 0:
            lv.release("b")
        elif op == "publish":
            lv.publish("b", EngineSample(running=ours + others, waiting=0, received_at=t))
        v = lv.backend_view("b", t)
        if v.engine is not None:
            assert v.engine == v.inflight + others
