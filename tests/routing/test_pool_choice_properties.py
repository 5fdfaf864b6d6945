"""Invariants of pool choice over random situations: the threshold hysteresis, declared reasons."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specrouter.backends import Pool
from specrouter.routing.costsource import profile_model
from specrouter.routing.decision import GroupState, Hints
from specrouter.routing.policy import Policy
from specrouter.routing.pool_choice import REASONS, decide
from specrouter.routing.strategies.registry import STRATEGIES
from tests.routing.helpers import group

MODEL = profile_model("h200-llama3-8b", 2048)
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
@given(strategy=st.sampled_from(sorted(STRATEGIES)), mode=st.sampled_from(["auto", "eagle",
       "baseline"]), eagle=st.integers(0, 80), base=st.integers(0, 80),
       eagle_ok=st.booleans(), base_ok=st.booleans(),
       requested=st.sampled_from([None, "eagle", "baseline"]), override=st.booleans())
def test_every_reason_given_is_a_declared_one(
    strategy: str, mode: str, eagle: int, base: int, eagle_ok: bool, base_ok: bool,
    requested: Pool | None, override: bool,
) -> None:
    """The reasons of `decide` are the metric labels and docs' list: none is undeclared."""
    if not (eagle_ok or base_ok):
        return
    policy = Policy(strategy=strategy, mode=mode, allow_client_override=override)
    view = group(eagle=eagle, base=base, eagle_ok=eagle_ok, base_ok=base_ok, accept=2.5,
                 accept_at=0.0)
    d = decide(policy, view, GroupState(), Hints(requested), 1.0, MODEL)
    assert d.reason in REASONS, d
