"""The load generator's measurements against a real simulated SGLang group."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest.generator import LoadGenerator
from loadtest.metrics import SLO, RequestResult, percentile, summarize, write_csv, write_json
from loadtest.procs import reset_engines, served_model
from loadtest.promptset import CHARS_PER_TOKEN, RequestShape, load_prompts, shape_messages
from loadtest.scenarios.common import run_async

OUTPUT_TOKENS = 24


def test_percentile_interpolates_like_numpy() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0.5) == pytest.approx(5.5)
    assert percentile(values, 0.9) == pytest.approx(9.1)
    assert percentile(values, 0.99) == pytest.approx(9.91)
    assert percentile([3.0], 0.99) == 3.0
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError):
        percentile(values, 1.5)


def test_prompts_are_shaped_to_the_target_length() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 50
    assert {"refactor", "tests", "bugfix", "agent"} <= {p.kind for p in prompts}
    for prompt in prompts[:10]:
        for target in (50, 1000):
            chars = sum(len(m["content"]) for m in shape_messages(prompt, target))
            others = sum(len(m["content"]) for m in prompt.messages[:-1])
            assert chars == max(target * CHARS_PER_TOKEN, others + CHARS_PER_TOKEN)


def test_tpot_and_slo_from_request_times() -> None:
    r = RequestResult(start=0.0, ok=True, ttft=0.1, e2e=1.1, output_tokens=11)
    assert r.tpot == pytest.approx(0.1)
    assert SLO(ttft_s=0.2, tpot_s=0.1).met(r)
    assert not SLO(ttft_s=0.2, tpot_s=0.05).met(r)
    # time-scaled runs are judged in simulated seconds: 0.1 s wall = 1 s simulated
    assert not SLO(ttft_s=0.2, tpot_s=0.1).met(r, time_scale=0.1)


def _run(url: str, concurrency: int, n: int, input_tokens: int = 200) -> list[RequestResult]:
    shape = RequestShape(served_model(url), input_tokens=input_tokens,
                         output_tokens=OUTPUT_TOKENS)

    async def go() -> list[RequestResult]:
        async with LoadGenerator(url, shape, load_prompts(), progress=False) as gen:
            return await gen.closed_loop(concurrency, num_requests=n)

    return run_async(go())


@pytest.mark.parametrize("pool", ["eagle", "baseline"])
def test_closed_loop_counts_tokens_and_times(sim_group: Callable[..., Any], pool: str,
                                             tmp_path: Path) -> None:
    sim = sim_group(profile="seed-coding", time_scale=0.05)
    results = _run(sim.url(pool), concurrency=4, n=8)
    assert len(results) == 8
    for r in results:
        assert r.ok, r.error
        assert r.output_tokens == OUTPUT_TOKENS  # ignore_eos + max_tokens, from usage
        assert r.prompt_tokens > 150  # ~200 tokens of prompt at 4 chars per token
        assert 1 <= r.chunks <= OUTPUT_TOKENS
        assert len(r.itl) == r.chunks - 1
        assert r.ttft is not None and r.e2e is not None and 0 < r.ttft < r.e2e
        assert r.tpot is not None and r.tpot > 0
    summary = summarize(results, time_scale=0.05)
    assert summary["completed"] == 8 and summary["errors"] == 0
    assert summary["output_tokens"] == 8 * OUTPUT_TOKENS
    wall = max(r.start + (r.e2e or 0) for r in results) - min(r.start for r in results)
    assert summary["output_tok_s"] == pytest.approx(8 * OUTPUT_TOKENS / (wall / 0.05))
    assert summary["ttft"]["p50"] <= summary["e2e"]["p50"]

    write_csv(tmp_path / "r.csv", results, extra={"pool": pool})
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert len(rows) == 8 and {row["output_tokens"] for row in rows} == {str(OUTPUT_TOKENS)}
    write_json(tmp_path / "s.json", summary)
    assert json.loads((tmp_path / "s.json").read_text())["completed"] == 8


def test_each_request_pastes_context_of_its_own(sim_group: Callable[..., Any]) -> None:
    """Single-turn requests share no padding, so the engine's prefix cache serves almost
    none of a run (one shared context would be served from cache after the first request);
    `reset_engines` starts the next config with that cache empty."""
    sim = sim_group(profile="seed-coding", time_scale=0.05)
    results = _run(sim.baseline_url, concurrency=2, n=8, input_tokens=1000)
    assert all(r.ok for r in results)
    state = sim.state("baseline")
    assert state["cached_tokens"] < 0.05 * state["prompt_tokens"], state
    assert state["cache_tokens"] > 0
    reset_engines([sim.baseline_url], seed=3)
    assert sim.state("baseline")["cache_tokens"] == 0


def test_context_labels_differ_and_repeat_with_the_seed() -> None:
    prompt = load_prompts()[0]
    a, b = shape_messages(prompt, 1000, "src/a.py"), shape_messages(prompt, 1000, "src/b.py")
    assert a != b and a == shape_messages(prompt, 1000, "src/a.py")
    assert sum(len(m["content"]) for m in a) == sum(len(m["content"]) for m in b)


def test_open_loop_and_errors_are_recorded(sim_group: Callable[..., Any]) -> None:
    sim = sim_group(profile="seed-coding", time_scale=0.05)
    sim.control("baseline", error_rate=1.0, error_status=503)
    shape = RequestShape(served_model(sim.baseline_url), input_tokens=50, output_tokens=4)

    async def go() -> list[RequestResult]:
        async with LoadGenerator(sim.baseline_url, shape, load_prompts(), progress=False) as gen:
            return await gen.open_loop(rate=50.0, num_requests=6)

    results = run_async(go())
    assert len(results) == 6
    assert all(not r.ok and r.status == 503 and "HTTP 503" in r.error for r in results)
    starts = [r.start for r in results]
    assert starts == sorted(starts)
    summary = summarize(results)
    assert summary["errors"] == 6 and summary["completed"] == 0


def test_trace_phases_keep_concurrency_across_boundaries(sim_group: Callable[..., Any]) -> None:
    """Two back-to-back phases of 2 users never have more than 2 requests in flight."""
    from loadtest.generator import Phase

    sim = sim_group(profile="seed-coding", time_scale=0.05)
    shape = RequestShape(served_model(sim.baseline_url), input_tokens=50, output_tokens=16)
    phases = [Phase("a", 20.0, concurrency=2), Phase("b", 20.0, concurrency=2),
              Phase("c", 10.0, concurrency=1)]

    async def go() -> list[RequestResult]:
        async with LoadGenerator(sim.baseline_url, shape, load_prompts(), progress=False,
                                 time_scale=0.05) as gen:
            return await gen.trace(phases)

    results = run_async(go())
    assert all(r.ok for r in results)
    assert {r.phase for r in results} == {"a", "b", "c"}
    for r in results:
        in_flight = sum(1 for o in results if o.start <= r.start < (o.end or 0.0))
        assert in_flight <= 2, f"{in_flight} requests in flight at {r.start:.3f}s"
    assert [r.phase for r in sorted(results, key=lambda r: r.start)][-1] == "c"
