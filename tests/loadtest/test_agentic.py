"""The agentic workload (prefix stability, growth, determinism), its driver against a real
simulated engine, and the scenario's goodput / cached-share / verdict arithmetic."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from typing import Any

from loadtest.agentic import (
    AgenticShape,
    Player,
    TurnResult,
    arrivals,
    chat_tokens,
    make_session,
    make_sessions,
    system_prompt,
)
from loadtest.metrics import SLO, RequestResult
from loadtest.procs import served_model
from loadtest.scenarios import agentic
from loadtest.scenarios.agentic import (
    CONTEXT_SAMPLE_RATE,
    AgenticSettings,
    add_arguments,
    cached_share,
    level_summary,
    mean_context_tokens,
    median_run,
    router_cost_model_env,
    router_slo_env,
    router_strategy_env,
    session_moves,
    settings_from_args,
    verdict,
)
from loadtest.scenarios.common import run_async
from loadtest.scenarios.sweep import COST_MODEL_CTX
from specrouter.routing.costsource import CostModelSource, profile_model
from specrouter.sim.text import chat_prompt_tokens
from tests.fixtures.sim import SimEngine

SHAPE = AgenticShape()


def test_sessions_share_the_system_prompt_and_keep_their_own_repository() -> None:
    a, b = make_session(SHAPE, 7, 0, 0.0), make_session(SHAPE, 7, 1, 1.0)
    system = system_prompt(SHAPE, 7)
    assert system == system_prompt(SHAPE, 7)  # every session starts with the same text
    assert abs(len(system) / SHAPE.chars_per_token - SHAPE.system_tokens) <= 1
    assert a.repo != b.repo and a.repo[:200] != b.repo[:200]
    assert SHAPE.repo_tokens_min <= len(a.repo) / SHAPE.chars_per_token <= SHAPE.repo_tokens_max
    assert system_prompt(SHAPE, 8) != system


def test_a_session_is_a_pure_function_of_seed_and_index() -> None:
    assert make_session(SHAPE, 7, 3, 2.0) == make_session(SHAPE, 7, 3, 2.0)
    assert make_session(SHAPE, 7, 3, 2.0) != make_session(SHAPE, 8, 3, 2.0)
    assert make_sessions(SHAPE, 7, 0.5, 8.0) == make_sessions(SHAPE, 7, 0.5, 8.0)
    # a session is the same whatever the arrival rate of the level it is played at
    low, high = make_sessions(SHAPE, 7, 0.2, 8.0), make_sessions(SHAPE, 7, 0.5, 8.0)
    assert low[0].turns == high[0].turns and low[0].repo == high[0].repo


def test_contexts_grow_every_turn_and_pass_thirty_thousand_tokens() -> None:
    sessions = make_sessions(SHAPE, 7, 0.5, 40.0)
    assert len(sessions) >= 10
    for s in sessions:
        contexts = s.context_tokens
        assert all(b > a for a, b in itertools.pairwise(contexts))
        assert contexts[-1] >= SHAPE.context_target_min
        assert len(s.turns) >= 3 and s.turns[0].think_s == 0.0
        assert all(t.think_s > 0 for t in s.turns[1:])
        added = [len(t.message) / SHAPE.chars_per_token for t in s.turns]
        assert all(SHAPE.turn_tokens_min <= n <= SHAPE.turn_tokens_max for n in added)


def test_answer_lengths_are_heavy_tailed_and_capped() -> None:
    lengths = sorted(t.max_tokens for s in make_sessions(SHAPE, 7, 1.0, 25.0) for t in s.turns)
    assert lengths[0] >= SHAPE.output_min and lengths[-1] <= SHAPE.output_max
    median = lengths[len(lengths) // 2]
    assert 0.7 * SHAPE.output_median <= median <= 1.3 * SHAPE.output_median
    assert lengths[int(len(lengths) * 0.99)] >= 3 * median  # a long tail


def test_arrivals_are_poisson_within_the_window() -> None:
    times = arrivals(0.5, 400.0, 7)
    assert all(0 <= t < 400.0 for t in times) and times == sorted(times)
    assert 160 <= len(times) <= 240


def test_token_estimate_is_the_simulators_count() -> None:
    s = make_session(SHAPE, 7, 0, 0.0)
    system = system_prompt(SHAPE, 7)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": s.repo + "\n" + s.turns[0].message}]
    assert s.context_tokens[0] == chat_prompt_tokens(messages, SHAPE.chars_per_token)
    assert s.context_tokens[0] == chat_tokens([system, s.repo + "\n" + s.turns[0].message],
                                              SHAPE.chars_per_token)


def test_player_resends_each_answer_as_the_server_streamed_it(
        sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("baseline", time_scale=0.01)
    shape = AgenticShape().scaled(0.02)
    sessions = make_sessions(shape, 7, 2.0, 1.0)[:2]
    player = Player([engine.url], served_model(engine.url), system_prompt(shape, 7), 0.01)

    async def play() -> list[TurnResult]:
        try:
            return await player.play(sessions)
        finally:
            player.close()

    turns = run_async(play())
    assert len(turns) == sum(len(s.turns) for s in sessions)
    assert all(t.request.ok for t in turns), [t.request.error for t in turns]
    for s in sessions:
        mine = sorted((t for t in turns if t.session == s.index), key=lambda t: t.turn)
        assert [t.request.output_tokens for t in mine] == [t.max_tokens for t in s.turns]
        assert mine[0].request.prompt_tokens == s.context_tokens[0]
        # each later prompt holds the earlier one, the answer and the new message
        for before, after, turn in zip(mine, mine[1:], s.turns[1:], strict=False):
            grown = after.request.prompt_tokens - before.request.prompt_tokens
            answer = grown - 8 - len(turn.message) / shape.chars_per_token
            assert answer >= before.request.output_tokens * 0.5


def _turn(session: int, turn: int, *, prompt: int = 1000, cached: int | None = None,
          backend: str = "", target: str = "t", tokens: int = 100, ok: bool = True,
          ttft: float = 0.5) -> TurnResult:
    r = RequestResult(start=float(session + turn), ok=ok, ttft=ttft, e2e=ttft + 1.0,
                      output_tokens=tokens, prompt_tokens=prompt, backend=backend)
    return TurnResult(session, turn, r, cached or 0, cached is not None, target)


def test_cached_share_counts_completed_turns_and_knows_when_nothing_was_reported() -> None:
    assert cached_share([_turn(0, 0), _turn(0, 1)]) is None
    turns = [_turn(0, 0, prompt=1000, cached=0), _turn(0, 1, prompt=3000, cached=2000),
             _turn(1, 0, prompt=5000, cached=5000, ok=False)]
    assert cached_share(turns) == 0.5


def test_session_moves_follow_the_backend_header_else_the_pinned_target() -> None:
    turns = [_turn(0, 0, backend="g0-eagle"), _turn(0, 2, backend="g0-eagle"),
             _turn(0, 1, backend="g1-baseline"), _turn(1, 0, target="a"),
             _turn(1, 1, target="a")]
    assert session_moves(turns) == {"moves": 2, "compared": 3, "share": 2 / 3}


def test_goodput_counts_only_turns_within_the_slo() -> None:
    turns = [_turn(0, 0, ttft=0.5, tokens=101), _turn(0, 1, ttft=3.0, tokens=101)]
    summary = level_summary(turns, SLO(2.0, 0.05), 1.0)
    assert summary["slo_met"] == 1
    # 101 good tokens over the span from the first start (0) to the last end (1 + 4)
    assert abs(summary["goodput_tok_s"] - 101 / 5.0) < 1e-9


def _level(**goodput: float) -> dict[str, dict[str, Any]]:
    shares = {"eagle": 0.80, "baseline": 0.85, "router": 0.82}
    return {c.replace("_", "-"): {"goodput_tok_s": g, "cached_share": shares.get(c)}
            for c, g in goodput.items()}


def test_verdict_ratios_against_best_static_cache_aware_and_adaptive() -> None:
    level = _level(eagle=100.0, baseline=150.0, router=200.0, sglang_cache_aware=190.0,
                   adaptive=180.0)
    level["sglang-cache_aware"] = level.pop("sglang-cache-aware")
    v = verdict(level)
    assert v["best_static"] == "baseline"
    assert abs(v["vs_best_static"]["ratio"] - 200 / 150) < 1e-9
    assert v["vs_best_static"]["met"] is True
    assert v["vs_cache_aware"]["met"] is False  # 1.05 < 1.1
    assert v["vs_adaptive"]["met"] is True
    assert v["cached_share"]["never_moves"] == 0.85
    assert abs(v["cached_share"]["gap_points"] - 3.0) < 1e-9
    assert v["cached_share"]["met"] is True


def test_the_slo_router_is_judged_on_its_own_and_told_the_limit_in_real_ms() -> None:
    level = _level(eagle=100.0, baseline=150.0, router=120.0)
    level["router-slo"] = {**level["router"], "goodput_tok_s": 180.0}
    assert abs(verdict(level)["vs_best_static"]["ratio"] - 120 / 150) < 1e-9
    assert abs(verdict(level, "router-slo")["vs_best_static"]["ratio"] - 180 / 150) < 1e-9
    # 50 ms simulated at time scale 0.2: answers reach the router 5x faster
    assert router_slo_env("router-slo", 0.05, 0.2) == {"SPECROUTER_AFFINITY__TPOT_SLO_MS": "10"}
    assert router_slo_env("router", 0.05, 0.2) == {}


def test_verdict_leaves_unmeasured_comparisons_open() -> None:
    v = verdict(_level(eagle=100.0, router=90.0))
    assert v["vs_best_static"]["met"] is False
    assert v["vs_cache_aware"] == {"ratio": None, "target": 1.1, "met": None}
    assert v["vs_adaptive"]["met"] is None


def test_player_sends_no_turn_after_its_stop_time() -> None:
    sessions = make_sessions(SHAPE.scaled(0.01), 7, 1.0, 3.0)
    # the target is never contacted: every turn is due after the stop time
    player = Player(["http://127.0.0.1:9"], "m", "system", 0.001, stop_s=0.0)
    turns = run_async(player.play(sessions))
    assert turns == [] and player.unsent_turns == sum(len(s.turns) for s in sessions)


def test_the_routers_cost_model_can_be_built_at_the_workloads_mean_context() -> None:
    sessions = make_sessions(SHAPE, 7, CONTEXT_SAMPLE_RATE, 30.0)
    contexts = [c for s in sessions for c in s.context_tokens]
    ctx = mean_context_tokens(SHAPE, 7, 30.0)
    assert ctx == round(sum(contexts) / len(contexts))
    assert 20_000 < ctx < 40_000  # the agentic contexts, not the sweep's 1,200 tokens
    source = CostModelSource.model_validate(
        json.loads(router_cost_model_env("seed-coding", ctx)["SPECROUTER_COST_MODEL"]))
    assert source.ctx == ctx


def test_the_judged_router_is_the_default_and_router_goodput_uses_goodput() -> None:
    s = AgenticSettings()
    for config in ("router", "router-noaffinity"):
        online = router_strategy_env(config, "seed-coding", 0.08, s, SHAPE)
        assert "SPECROUTER_COST_MODEL" not in online
        assert "strategy" not in json.loads(online["SPECROUTER_POLICY"])
    goodput = router_strategy_env("router-goodput", "seed-coding", 0.08, s, SHAPE)
    assert json.loads(goodput["SPECROUTER_POLICY"])["strategy"] == "goodput"
    assert json.loads(goodput["SPECROUTER_COST_MODEL"])["profile"] == "seed-coding"


def test_at_agentic_contexts_light_load_stays_on_eagle_on_seed_coding() -> None:
    """seed-coding's crossover at the sweep's short context is under two requests, so
    the goodput strategy moved a group of two or three sessions to the baseline (and
    their prefixes with it); at the workload's context it is past a dozen."""
    sweep = profile_model("seed-coding", ctx=COST_MODEL_CTX)
    agentic = profile_model("seed-coding", ctx=mean_context_tokens(SHAPE, 7, 30.0))
    accept = sweep.nominal_accept_length
    short = sweep.crossover(accept)
    assert short is not None and short < 2
    crossover = agentic.crossover(accept)
    assert crossover is not None and crossover > 10


def test_the_cost_model_context_is_the_sweeps_unless_asked() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    common = ["--profiles", "seed-coding"]
    args = parser.parse_args(common)
    args.seed, args.out, args.time_scale, args.quick = 7, None, 0.0, False
    assert settings_from_args(args).cost_model_ctx == COST_MODEL_CTX
    args = parser.parse_args([*common, "--cost-model-ctx", "0"])
    args.seed, args.out, args.time_scale, args.quick = 7, None, 0.0, False
    assert settings_from_args(args).cost_model_ctx == 0  # 0: mean_context_tokens


def test_a_repeated_cell_is_its_median_run_and_keeps_every_runs_goodput() -> None:
    runs = [{"goodput_tok_s": 80.0, "slo_met": 40}, {"error": "sim died"},
            {"goodput_tok_s": 52.0, "slo_met": 30}, {"goodput_tok_s": 70.0, "slo_met": 38}]
    cell = median_run(runs)
    # the measured runs ranked 52, 70, 80: the median's own figures, every run in order
    assert cell["slo_met"] == 38 and cell["goodput_tok_s"] == 70.0
    assert cell["goodput_runs"] == [80.0, None, 52.0, 70.0]
    assert median_run([runs[0]]) == runs[0]  # one run: as it was
    assert median_run([runs[1], runs[1]]) == runs[1]  # nothing measured
    # an even count takes the lower middle
    assert median_run([runs[0], runs[2]])["goodput_tok_s"] == 52.0


def test_a_stream_sets_each_profiles_arrival_window() -> None:
    s = agentic.stream(agentic.AgenticSettings())
    assert s.window_of("seed-coding") == 180.0 and s.window_of("h200-llama3-8b") == 120.0
    assert s.window_of("another-profile") == s.window_s == 30.0
    # the quick version keeps its own short window for every profile
    assert agentic.quick(s).window_of("h200-llama3-8b") == 8.0


def test_a_config_repeated_more_than_the_others_is_judged_by_its_median_run(
        monkeypatch: Any) -> None:
    played: list[tuple[str, int]] = []
    goodputs = {("router", 0): 900.0, ("router", 1): 650.0, ("router", 2): 950.0}

    def fake_run(config: str, profile: str, s: AgenticSettings, options: str,
                 log: Callable[[str], None], run: int = 0) -> list[dict[str, Any]]:
        played.append((config, run))
        return [{"goodput_tok_s": goodputs.get((config, run), 500.0), "cached_share": 0.8}]

    monkeypatch.setattr(agentic, "run_config", fake_run)
    monkeypatch.setattr(agentic, "sim_options", lambda: "")
    s = AgenticSettings(profiles=["h200-llama3-8b"], profile_rates={"h200-llama3-8b": [2.0]},
                        configs=["eagle", "router"], config_repeats={"router": 3})
    result = agentic.run_agentic(s, log=lambda _: None)
    # interleaved: every config once, then the repeated one again
    assert played == [("eagle", 0), ("router", 0), ("router", 1), ("router", 2)]
    (level,) = result["profiles"]["h200-llama3-8b"]
    assert level["configs"]["router"]["goodput_tok_s"] == 900.0
    assert level["configs"]["router"]["goodput_runs"] == [900.0, 650.0, 950.0]
    assert "goodput_runs" not in level["configs"]["eagle"]
    assert s.repeats_of("eagle") == 1 and agentic.quick(s).repeats_of("router") == 1
