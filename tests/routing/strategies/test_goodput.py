"""The goodput strategy against the measured H200 llama3-8b cost model."""

from __future__ import annotations

import itertools
import pathlib

import pytest

from specrouter.routing.costmodel import DraftConfig, GroupCostModel, model_from_step_table
from specrouter.routing.decision import GroupState, Hints
from specrouter.routing.policy import Policy
from specrouter.routing.pool_choice import decide
from specrouter.steptable import parse_step_table
from tests.fixtures.procs import CALIBRATION_DIR
from tests.routing.helpers import group


def llama() -> GroupCostModel:
    """The measured H200 llama3-8b step costs, chain draft 3/1/4, no EAGLE-3 cap."""
    text = (pathlib.Path(CALIBRATION_DIR) / "llama3-8b-ctx2048.jsonl").read_text()
    return model_from_step_table(parse_step_table(text), DraftConfig(3, 1, 4),
                                 eagle_max_batch=None)


GOODPUT = Policy(strategy="goodput", load_signal="inflight", goodput_margin=0.05,
                 goodput_min_dwell_s=1.0, accept_smoothing=1.0)


def test_goodput_switches_at_the_model_crossover() -> None:
    m = llama()
    st = GroupState()
    low = decide(GOODPUT, group(eagle=10, accept=2.5, accept_at=0.0), st, Hints(), 10.0, m)
    assert (low.pool, low.reason) == ("eagle", "goodput_eagle")
    assert low.predictions is not None and low.state.accept.ewma == 2.5
    high = decide(GOODPUT, group(eagle=70, accept=2.5, accept_at=0.0), low.state, Hints(), 20.0, m)
    assert (high.pool, high.reason) == ("baseline", "goodput_baseline")
    # The same load with a higher live accept length keeps EAGLE: the switch point moved.
    hi_acc = decide(GOODPUT, group(eagle=70, accept=4.0, accept_at=1.0), st, Hints(), 20.0, m)
    assert hi_acc.pool == "eagle"


def switches_near_crossover(policy: Policy) -> int:
    m = llama()
    x = m.crossover(2.5)
    assert x is not None
    st = GroupState()
    pools = []
    # Load oscillates around the crossover, one request every 10 ms for 2 s.
    for i in range(200):
        load = int(x) + (i % 3) - 1
        d = decide(policy, group(eagle=load, accept=2.5, accept_at=0.0), st, Hints(),
                   now=100.0 + i * 0.01, cost_model=m)
        st = d.state
        pools.append(d.pool)
    return sum(a != b for a, b in itertools.pairwise(pools))


def test_goodput_does_not_flap_near_crossover() -> None:
    assert switches_near_crossover(GOODPUT) == 0  # inside the margin band: hold
    # Without margin and dwell the same trace flips pool on most requests.
    bare = GOODPUT.model_copy(update={"goodput_margin": 0.0, "goodput_min_dwell_s": 0.0})
    assert switches_near_crossover(bare) > 50


def test_goodput_min_dwell_holds_after_a_switch() -> None:
    m = llama()
    g_hot = group(eagle=120, accept=2.0, accept_at=0.0)
    g_cold = group(eagle=1, accept=2.0, accept_at=0.0)
    d1 = decide(GOODPUT, g_hot, GroupState(), Hints(), 50.0, m)
    assert d1.pool == "baseline" and d1.state.since == 50.0
    d2 = decide(GOODPUT, g_cold, d1.state, Hints(), 50.5, m)
    assert (d2.pool, d2.reason) == ("baseline", "goodput_dwell_baseline")
    d3 = decide(GOODPUT, g_cold, d2.state, Hints(), 51.1, m)
    assert (d3.pool, d3.reason) == ("eagle", "goodput_eagle")


def test_goodput_dwell_never_holds_a_surge_on_eagle() -> None:
    """Just after the group went back to EAGLE-3, a surge still moves to the baseline."""
    m = llama()
    g_hot = group(eagle=120, accept=2.0, accept_at=0.0)
    g_cold = group(eagle=1, accept=2.0, accept_at=0.0)
    back = decide(GOODPUT, g_cold, GroupState(pool="baseline", since=40.0), Hints(), 50.0, m)
    assert (back.pool, back.state.since) == ("eagle", 50.0)
    surge = decide(GOODPUT, g_hot, back.state, Hints(), 50.1, m)
    assert (surge.pool, surge.reason) == ("baseline", "goodput_baseline")


def test_goodput_smooths_accept_length_per_new_reading() -> None:
    m = llama()
    p = GOODPUT.model_copy(update={"accept_smoothing": 0.5, "goodput_probe_s": 0.0})
    st = decide(p, group(accept=3.0, accept_at=1.0), GroupState(), Hints(), 1.0, m).state
    # The average starts at the model's nominal accept length: a first reading moves it.
    first = m.nominal_accept_length + 0.5 * (3.0 - m.nominal_accept_length)
    assert st.accept.ewma == pytest.approx(first)
    st = decide(p, group(accept=1.0, accept_at=2.0), st, Hints(), 2.0, m).state
    assert st.accept.ewma == pytest.approx(first + 0.5 * (1.0 - first))
    # The same reading seen again (many requests between polls) is not re-weighted.
    st = decide(p, group(accept=1.0, accept_at=2.0), st, Hints(), 2.1, m).state
    assert st.accept.ewma == pytest.approx(first + 0.5 * (1.0 - first))


def test_goodput_without_model_falls_back_to_threshold() -> None:
    d = decide(GOODPUT, group(eagle=40), GroupState(), Hints(), 0.0, None)
    assert (d.pool, d.reason) == ("baseline", "goodput_no_model")
