"""The pool decision: the rules every strategy shares, threshold and overflow."""

from __future__ import annotations

import pytest

from specrouter.routing.decision import (
    GroupState,
    HeaderError,
    Hints,
    NoHealthyPool,
    parse_pool_header,
)
from specrouter.routing.policy import Policy
from specrouter.routing.pool_choice import REASONS, decide
from tests.routing.helpers import group

THRESH = Policy(strategy="threshold", switch_up=16, switch_down=8, load_signal="inflight")


def run(policy: Policy, loads: list[int], state: GroupState | None = None) -> list[str]:
    """Decide at each group load in turn, carrying the group state; returns reasons."""
    st = state or GroupState()
    reasons = []
    for t, load in enumerate(loads):
        d = decide(policy, group(eagle=load), st, Hints(), now=float(t))
        assert d.reason in REASONS
        st = d.state
        reasons.append(f"{d.pool}:{d.reason}")
    return reasons


def test_threshold_hysteresis_up_hold_down() -> None:
    assert run(THRESH, [4, 12, 16, 12, 9, 8, 12]) == [
        "eagle:below_switch_down",
        "eagle:hysteresis_hold_eagle",
        "baseline:above_switch_up",
        "baseline:hysteresis_hold_baseline",
        "baseline:hysteresis_hold_baseline",
        "eagle:below_switch_down",
        "eagle:hysteresis_hold_eagle",
    ]


def test_threshold_state_is_per_group() -> None:
    hot = decide(THRESH, group("gpu0", eagle=20), GroupState(), Hints(), now=1.0)
    cold = decide(THRESH, group("gpu1", eagle=10), GroupState(), Hints(), now=1.0)
    assert (hot.pool, cold.pool) == ("baseline", "eagle")
    assert hot.state.pool == "baseline" and hot.state.since == 1.0
    # The same load in the band keeps each group on its own side.
    assert decide(THRESH, group("gpu0", eagle=10), hot.state, Hints(), 2.0).pool == "baseline"
    assert decide(THRESH, group("gpu1", eagle=10), cold.state, Hints(), 2.0).pool == "eagle"


def test_group_load_sums_both_servers() -> None:
    d = decide(THRESH, group(eagle=10, base=6), GroupState(), Hints(), now=0.0)
    assert (d.load, d.pool, d.reason) == (16.0, "baseline", "above_switch_up")


def test_overflow_cap_per_eagle_server() -> None:
    p = Policy(strategy="overflow", eagle_cap=4, load_signal="inflight")
    below = decide(p, group(eagle=3, base=50), GroupState(), Hints(), 0.0)
    full = decide(p, group(eagle=4, base=0), GroupState(), Hints(), 0.0)
    assert (below.pool, below.reason) == ("eagle", "below_eagle_cap")
    assert (full.pool, full.reason) == ("baseline", "eagle_cap_reached")


@pytest.mark.parametrize("mode", ["eagle", "baseline"])
def test_forced_modes_ignore_load(mode: str) -> None:
    p = Policy(mode=mode, strategy="threshold", switch_up=2, switch_down=1)
    for load in (0, 100):
        d = decide(p, group(eagle=load), GroupState(), Hints(), 0.0)
        assert (d.pool, d.reason) == (mode, "forced_mode")


def test_client_override_allowed_and_denied() -> None:
    hot = group(eagle=100)
    allowed = Policy(strategy="threshold", allow_client_override=True)
    denied = Policy(strategy="threshold", allow_client_override=False)
    d = decide(allowed, hot, GroupState(), Hints("eagle"), 0.0)
    assert (d.pool, d.reason) == ("eagle", "client_override")
    assert d.state == GroupState()  # an override does not move the group's hysteresis
    d = decide(denied, hot, GroupState(), Hints("eagle"), 0.0)
    assert (d.pool, d.reason) == ("baseline", "above_switch_up")
    # Override to an unhealthy pool falls back to the healthy one.
    d = decide(allowed, group(eagle_ok=False), GroupState(), Hints("eagle"), 0.0)
    assert (d.pool, d.reason) == ("baseline", "eagle_unhealthy")


def test_pool_header_parsing() -> None:
    assert parse_pool_header(" EAGLE ") == "eagle"
    assert parse_pool_header("baseline") == "baseline"
    assert parse_pool_header(None) is None and parse_pool_header("") is None
    with pytest.raises(HeaderError, match="x-specrouter-pool"):
        parse_pool_header("fast")


def test_unhealthy_pool_sends_group_to_the_other() -> None:
    forced_eagle = Policy(mode="eagle")
    d = decide(forced_eagle, group(eagle_ok=False), GroupState(), Hints(), 0.0)
    assert (d.pool, d.reason) == ("baseline", "eagle_unhealthy")
    d = decide(THRESH, group(eagle=100, base_ok=False), GroupState(), Hints(), 0.0)
    assert (d.pool, d.reason) == ("eagle", "baseline_unhealthy")
    with pytest.raises(NoHealthyPool):
        decide(THRESH, group(eagle_ok=False, base_ok=False), GroupState(), Hints(), 0.0)
