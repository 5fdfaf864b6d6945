"""Cost model against the measured H200 step costs in tests/data/calibration."""

from __future__ import annotations

import itertools
import pathlib

import pytest

from specrouter.routing.costmodel import (
    DraftConfig,
    GroupCostModel,
    SweepPoint,
    TableCurve,
    ewma,
    fit_curve,
    fit_group_model,
    model_from_profile,
    model_from_step_table,
    parse_step_table,
)
from specrouter.routing.policy import GroupState, Hints, Policy, decide, group_report
from tests.fixtures.procs import CALIBRATION_DIR
from tests.unit.helpers import group

CALIB = pathlib.Path(CALIBRATION_DIR)
CHAIN = DraftConfig(steps=3, topk=1, num_draft_tokens=4)
TREE16 = DraftConfig(steps=5, topk=4, num_draft_tokens=16)


def llama(draft: DraftConfig = CHAIN) -> GroupCostModel:
    rows = parse_step_table((CALIB / "llama3-8b-ctx2048.jsonl").read_text())
    return model_from_step_table(rows, draft, eagle_max_batch=None)


def test_ratio_matches_crossover_py_at_measured_batches() -> None:
    # Numbers printed by `python3 crossover.py llama3-8b-ctx2048.jsonl` (chain, accept 2.5).
    expected = {1: 1.83, 8: 1.73, 32: 1.16, 64: 0.85, 128: 0.66}
    m = llama()
    for b, r in expected.items():
        assert m.ratio(b, 2.5) == pytest.approx(r, abs=0.006)


def test_crossover_llama_chain_accept_2_5_between_32_and_64() -> None:
    x = llama().crossover(2.5)
    assert x is not None and 32 < x < 64


def test_crossover_moves_with_accept_length_and_draft_config() -> None:
    m = llama()
    xs = [m.crossover(a) for a in (1.6, 2.0, 3.0, 4.0)]
    assert all(x is not None for x in xs)
    assert xs == sorted(xs)  # type: ignore[type-var]
    assert xs[-1] > 128 and xs[0] < 16  # type: ignore[operator]
    tree = llama(TREE16).crossover(2.0)
    assert tree is not None and 8 < tree < 16  # crossover.py: 1.18 at B=8, 0.85 at B=16


def test_predictions_throughput_and_tpot_consistent() -> None:
    m = llama()
    p = m.predictions(16, 2.5)
    base_step = 6.201  # llama ctx2048 target_q1_ms at B=16
    assert p["baseline"].throughput_tok_s == pytest.approx(16 * 1000 / base_step)
    assert p["baseline"].tpot_ms == pytest.approx(base_step)
    eagle_step = 9.277 + 3 * 0.457
    assert p["eagle"].tpot_ms == pytest.approx(eagle_step / 2.5)


def test_max_batch_caps_the_batch_and_queues_the_rest() -> None:
    rows = parse_step_table((CALIB / "llama3-8b-ctx2048.jsonl").read_text())
    m = model_from_step_table(rows, CHAIN, eagle_max_batch=48)
    p = m.predict("eagle", 96, 3.0)
    assert p.batch == 48 and p.tpot_ms == pytest.approx(2 * m.predict("eagle", 48, 3.0).tpot_ms)


def test_table_errors_are_clear() -> None:
    rows = parse_step_table((CALIB / "llama3-8b-ctx2048.jsonl").read_text())
    with pytest.raises(ValueError, match="N >= 17"):
        model_from_step_table(rows, DraftConfig(3, 1, 17))
    with pytest.raises(ValueError, match="line 2"):
        parse_step_table('{"batch": 1, "target_q1_ms": 5}\nnot json\n')
    with pytest.raises(ValueError, match="choose one with ctx"):
        model_from_step_table([{**rows[0], "ctx": 1}, {**rows[1], "ctx": 2}], CHAIN)


def test_fit_recovers_step_curve_from_sweep() -> None:
    # Synthesise a sweep from known step curves, then fit them back.
    def base_ms(b: float) -> float:
        return 5.0 + 0.07 * b

    def eagle_ms(b: float) -> float:
        return 6.0 + 0.35 * b

    acc = 2.5
    conc = [1, 2, 4, 8, 16, 32, 64]
    base = [SweepPoint(c, 1000 * c / base_ms(c)) for c in conc]
    eagle = [SweepPoint(c, 1000 * c * acc / eagle_ms(c)) for c in conc]
    m = fit_group_model(base, eagle, acc)
    assert m.baseline.ms(40) == pytest.approx(base_ms(40), rel=1e-6)
    assert m.eagle.ms(40) == pytest.approx(eagle_ms(40), rel=1e-6)
    # Crossover where acc*base = eagle: 2.5*(5+0.07b) = 6+0.35b -> b = 6.5/0.175
    assert m.crossover(acc) == pytest.approx(6.5 / 0.175, abs=0.5)
    q = fit_curve([(1, 5.0), (2, 6.0), (4, 10.0)], quadratic=True)  # 3 points: exact parabola
    assert [q.ms(b) for b in (1, 2, 4)] == pytest.approx([5.0, 6.0, 10.0])
    with pytest.raises(ValueError, match="distinct batch"):
        fit_curve([(4, 1.0), (4, 2.0)])


def test_table_curve_interpolates_and_extrapolates() -> None:
    c = TableCurve(((4, 10.0), (1, 4.0), (8, 18.0)))
    assert (c.ms(0.5), c.ms(2), c.ms(6), c.ms(16)) == (4.0, 6.0, 14.0, 34.0)


def test_ewma() -> None:
    assert ewma(None, 3.0, 0.3) == 3.0
    assert ewma(3.0, 1.0, 0.5) == 2.0
    with pytest.raises(ValueError):
        ewma(1.0, 1.0, 0.0)


# --- goodput strategy ---------------------------------------------------------------------

GOODPUT = Policy(strategy="goodput", load_signal="inflight", goodput_margin=0.05,
                 goodput_min_dwell_s=1.0, accept_smoothing=1.0)


def test_goodput_switches_at_the_model_crossover() -> None:
    m = llama()
    st = GroupState()
    low = decide(GOODPUT, group(eagle=10, accept=2.5, accept_at=0.0), st, Hints(), 10.0, m)
    assert (low.pool, low.reason) == ("eagle", "goodput_eagle")
    assert low.predictions is not None and low.state.accept_ewma == 2.5
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
    assert st.accept_ewma == pytest.approx(first)
    st = decide(p, group(accept=1.0, accept_at=2.0), st, Hints(), 2.0, m).state
    assert st.accept_ewma == pytest.approx(first + 0.5 * (1.0 - first))
    # The same reading seen again (many requests between polls) is not re-weighted.
    st = decide(p, group(accept=1.0, accept_at=2.0), st, Hints(), 2.1, m).state
    assert st.accept_ewma == pytest.approx(first + 0.5 * (1.0 - first))


def test_goodput_without_model_falls_back_to_threshold() -> None:
    d = decide(GOODPUT, group(eagle=40), GroupState(), Hints(), 0.0, None)
    assert (d.pool, d.reason) == ("baseline", "goodput_no_model")


def test_group_report_for_policy_endpoint() -> None:
    m = llama()
    r = group_report(GOODPUT, group(eagle=70, accept=2.5, accept_at=0.0), GroupState(), 5.0, m)
    assert (r["choice"], r["reason"], r["load"]) == ("baseline", "goodput_baseline", 70.0)
    assert r["crossover"] == pytest.approx(m.crossover(2.5))
    assert r["predictions"]["baseline"]["throughput_tok_s"] > r["predictions"]["eagle"][
        "throughput_tok_s"]
    dead = group_report(GOODPUT, group(eagle_ok=False, base_ok=False), GroupState(), 5.0)
    assert (dead["choice"], dead["reason"]) == (None, "no_healthy_server")


def test_verify_width_rounds_up_and_ctx_takes_nearest() -> None:
    rows = parse_step_table((CALIB / "llama3-8b-ctx2048.jsonl").read_text())
    rows += parse_step_table((CALIB / "llama3-8b-ctx8192.jsonl").read_text())
    m5 = model_from_step_table(rows, DraftConfig(3, 1, 5), ctx=3000, eagle_max_batch=None)
    m8 = model_from_step_table(rows, DraftConfig(3, 1, 8), ctx=2048, eagle_max_batch=None)
    assert m5.eagle.ms(16) == m8.eagle.ms(16) == pytest.approx(9.852 + 3 * 0.457)
    long = model_from_step_table(rows, CHAIN, ctx=9000, eagle_max_batch=None)
    assert long.baseline.ms(16) == pytest.approx(8.998)  # the ctx 8192 row


def test_model_from_simulator_profile() -> None:
    profile = {"draft": {"steps": 3, "topk": 1, "num_draft_tokens": 4}, "accept_length": 2.5,
               "eagle": {"max_running_requests": 48},
               "baseline": {"max_running_requests": 256}}
    rows = parse_step_table((CALIB / "llama3-8b-ctx2048.jsonl").read_text())
    m = model_from_profile(profile, rows)
    assert (m.nominal_accept_length, m.eagle_max_batch, m.baseline_max_batch) == (2.5, 48, 256)
    with pytest.raises(ValueError, match="draft"):
        model_from_profile({}, rows)
