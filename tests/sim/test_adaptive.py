"""The adaptive engine kind: SGLang 0.5.23 --speculative-adaptive's step choice, its step
cost from the shared step table, and one engine with a pair's memory over HTTP."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

import pytest

from loadtest import loopback
from specrouter.sim import cli, physics
from specrouter.sim.adaptive import AdaptiveSteps, spec_capture_batch_sizes
from specrouter.sim.profile import engine_limits, load_profile
from specrouter.sim.sweep import closed_loop
from tests.fixtures.sim import SimEngine


def test_tiers_route_padded_batch_sizes() -> None:
    steps = AdaptiveSteps(max_running_requests=256, initial_steps=3)
    assert steps.steps_for_batch(1) == 3  # tier 1 {1,3,5,7} starts at --speculative-num-steps
    assert steps.steps_for_batch(8) == 3  # tier 8 {0,1,3}
    assert steps.steps_for_batch(33) == 1  # pads to 40, tier 32 {0,1}: its middle candidate
    assert steps.steps_for_batch(60) == 1
    assert steps.steps_for_batch(61) == 0  # pads to 64: no drafting from there on
    assert steps.steps_for_batch(200) == 0
    assert spec_capture_batch_sizes(48)[-3:] == [40, 44, 48]


def test_steps_follow_the_accepted_drafts() -> None:
    steps = AdaptiveSteps(max_running_requests=256, initial_steps=3)
    for _ in range(15):  # every draft accepted: 10 warm-up batches, then a decision
        steps.on_verify([3, 3, 3], batch=2)
    assert steps.steps_for_batch(2) == 5
    for _ in range(35):  # decisions at 15 (3 -> 0), 20 (probe 1), 25 (0), 30 (1), 35 (0)
        steps.on_verify([0, 0, 0, 0, 0, 0, 0, 0], batch=8)
    assert steps.steps_for_batch(8) == 0  # nothing accepted: stop drafting at this size
    for _ in range(5):  # at 0 steps the EMA stands still; the next decision probes 1
        steps.on_verify([0] * 8, batch=8)
    assert steps.steps_for_batch(8) == 1
    assert steps.steps_for_batch(2) == 5  # each tier decides alone


def test_step_cost_is_draft_steps_plus_verify_of_width_steps_plus_one() -> None:
    profile = load_profile("h200-llama3-8b")
    assert physics.adaptive_step_ms(profile, 16, 2048, 3) == pytest.approx(
        physics.eagle_step_ms(profile, 16, 2048))  # the pair's EAGLE-3 setting
    q1 = profile.step_table.cost("target_q1_ms", 16, 2048)
    q4 = profile.step_table.cost("target_q4_ms", 16, 2048)
    draft = profile.step_table.cost("draft_step_ms", 16, 2048)
    assert physics.adaptive_step_ms(profile, 16, 2048, 0) == pytest.approx(q1 + draft)
    assert physics.adaptive_step_ms(profile, 16, 2048, 1) == pytest.approx(
        q1 + (q4 - q1) / 3 + draft)  # width 2 between the measured widths 1 and 4


def test_accept_length_per_step_count_keeps_the_chain_probability() -> None:
    model = physics.AcceptModel.for_mean(2.5, 4)
    assert model.with_max_len(4).mean == pytest.approx(2.5)
    assert model.with_max_len(1).mean == 1.0
    assert 2.5 < model.with_max_len(8).mean < 8


def test_adaptive_engine_drafts_alone_and_decodes_plainly_at_high_batch() -> None:
    profile = load_profile("h200-llama3-8b")
    limits = engine_limits(profile, "adaptive")
    assert limits.kv_capacity_tokens == (profile.eagle.kv_capacity_tokens
                                         + profile.baseline.kv_capacity_tokens)
    assert limits.max_running_requests == profile.baseline.max_running_requests

    def rate(kind: str, concurrency: int) -> float:
        return asyncio.run(closed_loop(profile, kind, concurrency, rounds=2)).throughput_tok_s

    assert rate("adaptive", 1) > 1.6 * rate("baseline", 1)  # drafts like EAGLE-3 alone
    high = rate("adaptive", 128)
    assert high > 1.2 * rate("eagle", 128)  # not capped at 48 slots, not drafting
    assert high < rate("baseline", 128)  # the draft model still extends its KV per step


def test_adaptive_engine_over_http(sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("adaptive", profile="h200-llama3-8b", time_scale=0.05,
                        sglang_version="0.5.23")
    answer = loopback.post(f"{engine.url}/generate", json={
        "text": "hello", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}).json()
    assert answer["meta_info"]["completion_tokens"] == 40
    assert answer["meta_info"]["spec_verify_ct"] < 40  # several tokens per step
    info = loopback.get(f"{engine.url}/server_info").json()
    assert info["speculative_adaptive"] is True and info["speculative_algorithm"] == "EAGLE3"
    state = engine.state()
    assert state["adaptive_steps"] == {"1": 3, "8": 3, "32": 1, "64": 0}
    assert state["kv_capacity_tokens"] == 900_000


def test_cli_refuses_adaptive_on_a_release_without_it(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--single", "adaptive", "--port", "1", "--sglang-version",
                              "0.5.10"])
    assert cli.run(args) == 2
    assert "no --speculative-adaptive" in capsys.readouterr().err
