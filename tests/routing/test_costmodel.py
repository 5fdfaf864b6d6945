"""Cost model against the measured H200 step costs in tests/data/calibration."""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest

from specrouter.routing.costmodel import (
    ContextCostModel,
    DraftConfig,
    GroupCostModel,
    SweepPoint,
    TableCurve,
    fit_curve,
    fit_group_model,
    model_from_profile,
    model_from_step_table,
)
from specrouter.steptable import parse_step_table
from tests.fixtures.procs import CALIBRATION_DIR

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


def two_contexts() -> list[dict[str, float]]:
    rows = parse_step_table((CALIB / "llama3-8b-ctx2048.jsonl").read_text())
    return rows + parse_step_table((CALIB / "llama3-8b-ctx8192.jsonl").read_text())


def test_a_table_of_several_contexts_is_read_at_the_context_asked() -> None:
    rows = two_contexts()
    model = model_from_step_table(rows, CHAIN, eagle_max_batch=None)
    assert isinstance(model, ContextCostModel)
    at = {c: model_from_step_table(rows, CHAIN, ctx=c, eagle_max_batch=None)
          for c in (2048, 8192)}
    for pool in ("eagle", "baseline"):
        short, long = at[2048].curve(pool).ms(16), at[8192].curve(pool).ms(16)
        assert model.curve(pool).ms(16) == short  # before any traffic: the smallest
        assert model.at_context(None).curve(pool).ms(16) == short
        assert model.at_context(1000).curve(pool).ms(16) == short  # clamped below
        assert model.at_context(30000).curve(pool).ms(16) == long  # and above
        assert model.at_context(3584).curve(pool).ms(16) == pytest.approx(
            short + (long - short) * 0.25)
    # attention over the longer context costs EAGLE-3's verify more than the baseline's
    # step: the crossover moves with the context
    assert model.at_context(8192).crossover(2.5) != pytest.approx(
        model.at_context(2048).crossover(2.5), abs=0.5)
    assert model.at_context(8192).crossover(2.5) == pytest.approx(at[8192].crossover(2.5))


def test_a_context_model_keeps_its_settings_at_every_context() -> None:
    model = replace(model_from_step_table(two_contexts(), CHAIN), nominal_accept_length=3.0,
                    baseline_max_batch=64)
    read = model.at_context(5000)
    assert (read.nominal_accept_length, read.baseline_max_batch, read.eagle_max_batch) == (
        3.0, 64, 48)
    plain = model_from_step_table(two_contexts(), CHAIN, ctx=5000)
    assert not isinstance(plain, ContextCostModel) and plain.at_context(30000) is plain
