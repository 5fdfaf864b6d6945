"""The cost model and the shipped profiles, checked without HTTP (simulated clock, exact)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

from specrouter.sim import physics
from specrouter.sim.engine import Engine, SimRequest
from specrouter.sim.gpu import SharedGpu, SimClock
from specrouter.sim.profile import Profile, ProfileError, load_profile, load_step_table
from specrouter.sim.sweep import SweepPoint, closed_loop
from specrouter.sim.text import WordStream
from tests.fixtures.procs import CALIBRATION_DIR

CALIBRATION = Path(CALIBRATION_DIR)
PROFILES = Path(__file__).resolve().parents[2] / "specrouter" / "sim" / "profiles"


def _sweep(profile: str, kind: str, concurrency: int) -> SweepPoint:
    return asyncio.run(closed_loop(load_profile(profile), kind, concurrency))


def test_step_table_interpolates_measured_rows() -> None:
    table = load_step_table(PROFILES / "llama3-8b.jsonl")
    assert table.cost("target_q1_ms", 64, 2048) == pytest.approx(9.381)
    assert table.cost("target_q1_ms", 48, 2048) == pytest.approx((7.277 + 9.381) / 2)
    mid_ctx = table.cost("target_q1_ms", 64, 5120)
    assert mid_ctx == pytest.approx((9.381 + 20.452) / 2)
    # ctx8192 has no batch 8 row: filled between its batch 4 and 16 rows
    assert table.cost("target_q1_ms", 8, 8192) == pytest.approx(6.208 + (8.998 - 6.208) / 3)


def test_shipped_table_is_the_calibration_data() -> None:
    shipped = [json.loads(line) for line in (PROFILES / "llama3-8b.jsonl").read_text().splitlines()]
    measured = [json.loads(line) for name in ("llama3-8b-ctx2048.jsonl", "llama3-8b-ctx8192.jsonl")
                for line in (CALIBRATION / name).read_text().splitlines() if line.strip()]
    assert shipped == measured


def test_eagle_step_is_draft_steps_plus_verify() -> None:
    profile = load_profile("h200-llama3-8b")
    cost = physics.eagle_step_ms(profile, 32, 2048)
    assert cost == pytest.approx(13.791 + 3 * 0.63)
    assert physics.decode_step_ms(profile, 32, 2048) == pytest.approx(7.277)


def test_prefill_grows_with_prompt_tokens() -> None:
    profile = load_profile("seed-coding")
    assert physics.prefill_ms(profile, 2000, False) > physics.prefill_ms(profile, 1000, False)
    assert physics.prefill_ms(profile, 1000, True) > physics.prefill_ms(profile, 1000, False)


@pytest.mark.parametrize("mean", [1.0, 1.6, 2.5, 3.4, 4.0])
def test_accept_samples_have_the_requested_mean_and_bounds(mean: float) -> None:
    model = physics.AcceptModel.for_mean(mean, 4)
    rng = random.Random(3)
    samples = [model.sample(rng) for _ in range(20000)]
    assert min(samples) >= 1 and max(samples) <= 4
    assert sum(samples) / len(samples) == pytest.approx(mean, rel=0.03)


def test_bad_profiles_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"step_table": "missing.jsonl"}))
    with pytest.raises(ProfileError, match="cannot read step table"):
        load_profile(str(bad))
    (tmp_path / "t.jsonl").write_text(json.dumps({"batch": 1, "ctx": 1, "target_q1_ms": 1.0,
                                                  "draft_step_ms": 0.1}) + "\n")
    bad.write_text(json.dumps({"step_table": "t.jsonl"}))
    with pytest.raises(ProfileError, match="target_qN_ms column with N >= 4"):
        load_profile(str(bad))


def test_user_profile_file_with_measured_table(tmp_path: Path) -> None:
    (tmp_path / "steps.jsonl").write_text((PROFILES / "llama3-8b.jsonl").read_text())
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "step_table": "steps.jsonl",
                                "accept_length": 3.0, "eagle": {"max_running_requests": 16}}))
    profile = load_profile(str(path))
    assert profile.name == "mine" and profile.eagle.max_running_requests == 16
    assert profile.accept_length == 3.0


# --- calibration: the profiles' targets, on the simulated clock -----------------------------

def test_seed_coding_hits_reference_throughput_at_64() -> None:
    baseline = _sweep("seed-coding", "baseline", 64).throughput_tok_s
    eagle = _sweep("seed-coding", "eagle", 64).throughput_tok_s
    assert baseline == pytest.approx(773, rel=0.10)
    assert eagle == pytest.approx(354, rel=0.10)


def test_seed_coding_eagle_wins_only_at_concurrency_1() -> None:
    b1, e1 = _sweep("seed-coding", "baseline", 1), _sweep("seed-coding", "eagle", 1)
    speedup = b1.mean_latency_s / e1.mean_latency_s
    assert 1.05 <= speedup <= 1.20
    for c in (2, 4, 16, 32):
        assert (_sweep("seed-coding", "baseline", c).throughput_tok_s
                > _sweep("seed-coding", "eagle", c).throughput_tok_s), c


def test_h200_profile_crossover_matches_calibration() -> None:
    """calibration/README: chain 3/1/4 at accept 2.5, EAGLE wins up to B~32, loses from 64."""
    for c in (1, 8, 32):
        assert (_sweep("h200-llama3-8b", "eagle", c).throughput_tok_s
                > _sweep("h200-llama3-8b", "baseline", c).throughput_tok_s), c
    for c in (64, 128):
        assert (_sweep("h200-llama3-8b", "eagle", c).throughput_tok_s
                < _sweep("h200-llama3-8b", "baseline", c).throughput_tok_s), c
    # batch 1: EAGLE throughput ratio = accept x q1 / (q4 + 3 draft) from the table, +-10%
    e1 = _sweep("h200-llama3-8b", "eagle", 1).throughput_tok_s
    b1 = _sweep("h200-llama3-8b", "baseline", 1).throughput_tok_s
    expected = 2.5 * 5.141 / (6.066 + 3 * 0.323)
    assert e1 / b1 == pytest.approx(expected, rel=0.10)


def test_seed_coding_table_is_its_documented_formula() -> None:
    from specrouter.sim.seedfit import TABLE, render

    assert TABLE.read_text() == render()


def _busy_engine() -> tuple[Profile, Engine]:
    """A baseline engine at time scale 1 (inside a running loop), decoding one endless
    request."""
    profile = load_profile("h200-llama3-8b")
    gpu = SharedGpu(SimClock(1.0))
    engine = Engine("t", "baseline", profile, gpu, 7, profile.baseline)
    engine.start()
    engine.submit(SimRequest("busy", 16, 10**6, 10**6, WordStream(random.Random(1)),
                             gpu.clock.real()))
    return profile, engine


def test_clock_catches_up_after_the_event_loop_was_blocked() -> None:
    """Steps are booked at absolute deadlines: a loop blocked for 60 ms makes the next sleeps
    shorter, so the simulated GPU time still matches the real time elapsed."""

    async def run() -> tuple[float, float]:
        _, engine = _busy_engine()
        clock = engine.clock
        await asyncio.sleep(0.05)
        start_real, start_busy = clock.real(), engine.counters.busy_sim_s
        for _ in range(3):
            time.sleep(0.06)  # the loop is blocked: no step can start
            await asyncio.sleep(0.1)
        elapsed = clock.real() - start_real
        busy = engine.counters.busy_sim_s - start_busy
        await engine.stop()
        return elapsed, busy

    elapsed, busy = asyncio.run(run())
    assert busy == pytest.approx(elapsed, abs=0.02)


def test_a_catch_up_never_serves_a_request_before_it_arrived() -> None:
    """After the event loop was blocked, the engine books the steps it owes in the past; a
    request that arrives right then still gets its prefill no earlier than its arrival, so
    its first token comes at least one prefill after it (never a latency under the GPU's)."""

    async def run() -> tuple[float, float, float]:
        profile, engine = _busy_engine()
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the loop is blocked: the engine falls 0.2 s behind
        late = SimRequest("late", 2000, 4, 4, WordStream(random.Random(2)),
                          engine.clock.real())
        engine.submit(late)
        while late.first_token_real is None:
            late.event.clear()
            await late.event.wait()
        await engine.stop()
        assert late.first_token_real is not None
        return late.arrival_real, late.first_token_real, physics.prefill_ms(profile, 2000,
                                                                            False)

    arrival, first, prefill_ms = asyncio.run(run())
    assert first - arrival >= prefill_ms / 1000.0 - 1e-9
