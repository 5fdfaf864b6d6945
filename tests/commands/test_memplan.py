"""The planner against SGLang's memory rule, replayed on a simulated GPU ledger.

`SimulatedGpu` is written from SGLang's code, independently of the planner: each process
takes its CUDA context, measures free memory (`total`), loads its weights (0.5.23: target and
draft before the pool is profiled; 0.5.10: the draft after), sizes its KV pool as
`min((avail - total * (1 - fraction)) // cell, max_total_tokens)`, and allocates its
activations only later, when it serves (lazily): the second server starts while the first
one's headroom is still free.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from specrouter.commands.memplan import (
    GIB,
    PRESETS,
    Plan,
    PlanError,
    PlanInput,
    ServerWant,
    Workspace,
    kv_tokens_for,
    plan_pair,
    prefill_graph_sizes,
    sglang_reserve_gib,
)

LLAMA_BPT = PRESETS["llama3-8b"].bytes_per_token()
LLAMA_DRAFT_BPT = PRESETS["llama3-8b"].bytes_per_token(layers=1)


class OutOfMemory(AssertionError):
    pass


@dataclass
class SimulatedGpu:
    free_gib: float
    events: list[str] = field(default_factory=list)

    def _take(self, gib: float, what: str) -> None:
        if gib > self.free_gib + 1e-9:
            raise OutOfMemory(f"{what}: CUDA out of memory ({self.free_gib:.2f} GiB free, "
                              f"{gib:.2f} wanted)")
        self.free_gib -= gib

    def start_sglang(self, ctx: float, fraction: float, weights: float, bpt: int,
                     cap: int | None, draft: float = 0.0, draft_inside: bool = True) -> int:
        self._take(ctx, "context")
        total = self.free_gib  # get_available_gpu_memory() at start
        self._take(weights + (draft if draft_inside else 0.0), "weights")
        rest = self.free_gib - total * (1 - fraction)
        assert rest > 0, "SGLang: Not enough memory. Please try to increase --mem-fraction-static"
        tokens = int(rest * GIB) // bpt
        if cap is not None:
            tokens = min(tokens, cap)
        self._take(tokens * bpt / GIB, "kv pool")
        if not draft_inside:
            self._take(draft, "draft weights")
        return tokens

    def serve(self, headroom: float, who: str) -> None:
        self._take(headroom, f"{who} activations")


def pair(gpu: float = 139.8, eagle_kv: int | None = 200_000, base_kv: int | None = None,
         headroom: float = 13.5, first: str = "eagle", model: float = 14.96,
         draft: float = 0.8) -> PlanInput:
    return PlanInput(
        gpu_free_gib=gpu,
        eagle=ServerWant("eagle", model, LLAMA_BPT + LLAMA_DRAFT_BPT, eagle_kv, headroom,
                         draft_gib=draft),
        baseline=ServerWant("baseline", model, LLAMA_BPT, base_kv, headroom),
        first=first,  # type: ignore[arg-type]
        cuda_context_gib=0.5,
    )


def replay(spec: PlanInput, draft_inside: bool = True, capped: bool = True,
           plan: Plan | None = None) -> dict[str, int]:
    """Start both servers in the planned order on a fresh simulated GPU (the second once
    the first is ready, activations not yet allocated), then both serve at their peaks."""
    plan = plan or plan_pair(spec)
    gpu = SimulatedGpu(spec.gpu_free_gib)
    tokens = {}
    for server in plan.servers:
        want = spec.eagle if server.role == "eagle" else spec.baseline
        tokens[server.role] = gpu.start_sglang(
            spec.cuda_context_gib, server.mem_fraction_static, want.weights_gib,
            want.kv_bytes_per_token, server.max_total_tokens if capped else None,
            draft=want.draft_gib, draft_inside=draft_inside,
        )
    for server in plan.servers:
        want = spec.eagle if server.role == "eagle" else spec.baseline
        gpu.serve(want.headroom_gib, server.role)
    for server in plan.servers:
        assert tokens[server.role] == server.max_total_tokens
    assert gpu.free_gib == pytest.approx(plan.unused_gib, abs=2e-3)
    return tokens


def test_llama_shapes_match_config_json() -> None:
    # 2 (K,V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes (bf16)
    assert LLAMA_BPT == 131_072
    assert LLAMA_DRAFT_BPT == 4_096
    assert PRESETS["qwen3-32b"].bytes_per_token() == 2 * 64 * 8 * 128 * 2


def test_eagle_first_then_baseline_fills_the_rest() -> None:
    tokens = replay(pair())
    assert tokens["eagle"] == 200_000  # capped: exactly the planned pool
    assert tokens["baseline"] > 400_000  # the 8B baseline gets the rest of an H200


@pytest.mark.parametrize("draft_inside", [True, False], ids=["0.5.23", "0.5.10"])
def test_the_plan_holds_wherever_sglang_loads_the_draft(draft_inside: bool) -> None:
    tokens = replay(pair(), draft_inside=draft_inside)
    assert tokens == {"eagle": 200_000, "baseline": plan_pair(pair()).servers[1].max_total_tokens}


def test_without_the_cap_the_baseline_takes_the_eagle_headroom_and_runs_out() -> None:
    # The second server starts while the first one's activations are not yet allocated:
    # it measures that headroom as free and, uncapped, turns it into KV pool.
    plan = plan_pair(pair())
    with pytest.raises(OutOfMemory, match="activations: CUDA out of memory"):
        replay(pair(), capped=False, plan=plan)


def test_the_draft_is_budgeted_once_next_to_the_pool() -> None:
    eagle = plan_pair(pair()).by_role("eagle")
    assert eagle.weights_gib == 14.96 and eagle.draft_gib == 0.8
    static = 14.96 + 0.8 + 200_000 * (LLAMA_BPT + LLAMA_DRAFT_BPT) / GIB
    # the fraction holds target + draft + pool, rounded up to SGLang's three decimals
    assert static <= eagle.mem_fraction_static * eagle.free_at_start_gib < static + 0.15
    assert eagle.peak_gib == pytest.approx(0.5 + static + 13.5, abs=1e-3)


def test_second_server_fraction_is_of_what_the_first_leaves_at_its_peak() -> None:
    plan = plan_pair(pair())
    eagle, baseline = plan.servers
    assert baseline.free_at_start_gib == pytest.approx(139.8 - eagle.peak_gib - 0.5, abs=1e-3)
    assert plan.unused_gib == pytest.approx(0.0, abs=1e-3)


def test_baseline_first_with_both_budgets_fixed() -> None:
    tokens = replay(pair(first="baseline", eagle_kv=150_000, base_kv=400_000))
    assert tokens == {"baseline": 400_000, "eagle": 150_000}


def test_small_gpu_fits_with_small_budgets() -> None:
    tokens = replay(pair(gpu=79.2, eagle_kv=100_000, base_kv=120_000, headroom=10.0))
    assert tokens == {"eagle": 100_000, "baseline": 120_000}


def test_kv_tokens_for_is_sglang_formula() -> None:
    # total 100 GiB, weights 20, fraction 0.5: rest = 80 - 50 = 30 GiB
    assert kv_tokens_for(100.0, 0.5, 20.0, 1 << 20) == 30 * 1024
    assert kv_tokens_for(100.0, 0.5, 20.0, 1 << 20, cap=1000) == 1000


def test_reserve_is_sglangs_rule_for_the_pinned_workspace() -> None:
    # 0.5.23 memory_hook: 512 + 8192*1.5 + 1/8*1024 + 256*2 + 58 prefill graphs * 8 (MiB)
    assert len(prefill_graph_sizes(8192)) == 58
    h200 = sglang_reserve_gib(139.8, Workspace(8192, 256), speculative=False)
    assert h200 == pytest.approx((512 + 12288 + 128 + 512 + 58 * 8) / 1024)
    # a small workspace on a GPU over 60 GiB is raised to SGLang's 10 GiB floor
    assert sglang_reserve_gib(139.8, Workspace(2048, 8), speculative=False) == 10.0
    assert sglang_reserve_gib(40.0, Workspace(2048, 8), speculative=False) < 4
    # 0.5.10 adds 4 GiB for an EAGLE draft and its graphs; 0.5.23 does not
    assert sglang_reserve_gib(139.8, Workspace(8192, 48), True, "0.5.10") == pytest.approx(
        sglang_reserve_gib(139.8, Workspace(8192, 48), True, "0.5.23") + 4)


def test_refuses_first_server_that_does_not_fit() -> None:
    with pytest.raises(PlanError, match=r"eagle server \(starts first\).*short by"):
        plan_pair(pair(gpu=80, eagle_kv=900_000))


def test_refuses_second_server_and_blames_the_first() -> None:
    with pytest.raises(PlanError) as info:
        plan_pair(pair(eagle_kv=600_000, base_kv=400_000))
    message = str(info.value)
    assert "baseline server (starts second)" in message
    assert "short by" in message and "the eagle server, started first, holds up to" in message


def test_refuses_when_headroom_leaves_no_kv_pool() -> None:
    with pytest.raises(PlanError, match="any KV pool"):
        plan_pair(pair(gpu=48, eagle_kv=50_000, headroom=12.0))


def test_first_server_needs_an_explicit_budget() -> None:
    with pytest.raises(PlanError, match="give its KV tokens"):
        plan_pair(pair(eagle_kv=None))


def _cli(*extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "specrouter", "plan", "--gpu-mem-gib", "139.8",
            "--model-gib", "14.96", "--draft-gib", "0.8", "--model-shape", "llama3-8b", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_cli_json_has_fractions_tokens_and_flags() -> None:
    done = _cli("--eagle-kv-tokens", "200000", "--json", "--eagle-port", "31000")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    eagle, baseline = data["servers"]
    assert eagle["role"] == "eagle" and eagle["max_total_tokens"] == 200_000
    flags = data["flags"]["eagle"]
    assert flags[flags.index("--mem-fraction-static") + 1] == str(eagle["mem_fraction_static"])
    assert flags[flags.index("--max-total-tokens") + 1] == "200000"
    assert flags[flags.index("--chunked-prefill-size") + 1] == "8192"
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "48"
    base_flags = data["flags"]["baseline"]
    assert base_flags[base_flags.index("--max-total-tokens") + 1] == str(
        baseline["max_total_tokens"])
    assert base_flags[base_flags.index("--cuda-graph-max-bs-decode") + 1] == "256"
    for flag in ("--speculative-algorithm", "--speculative-draft-model-path",
                 "--speculative-num-steps", "--speculative-eagle-topk",
                 "--speculative-num-draft-tokens", "--enable-metrics", "--enable-cache-report",
                 "--max-running-requests"):
        assert flag in flags
    assert "--enable-cache-report" in data["flags"]["baseline"]
    assert flags[flags.index("--port") + 1] == "31000"
    assert "--speculative-algorithm" not in data["flags"]["baseline"]
    assert str(baseline["mem_fraction_static"]) in data["flags"]["baseline"]


def test_cli_refusal_exits_2_with_reason() -> None:
    done = _cli("--eagle-kv-tokens", "2000000")
    assert done.returncode == 2
    assert "refused" in done.stderr and "short by" in done.stderr


def test_cli_refuses_nonsense_sizes() -> None:
    done = _cli("--eagle-kv-tokens", "200000", "--headroom-gib", "-1")
    assert done.returncode == 2 and "--headroom-gib must be >= 0" in done.stderr


def test_cli_text_prints_kv_and_cache_capacity_and_the_derived_headroom() -> None:
    done = _cli("--eagle-kv-tokens", "200000")
    assert done.returncode == 0, done.stderr
    assert ("KV capacity 200000 tokens, which is also its prefix-cache capacity"
            in done.stdout)
    assert "headroom 13.17" in done.stdout  # SGLang's reserve for chunk 8192, graphs to 48


def test_cli_extra_args_are_shell_split_with_braces_kept() -> None:
    done = _cli("--eagle-kv-tokens", "200000", "--json",
                """--baseline-extra-args=--json-model-override-args '{"rope": 1}' --x""")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["flags"]["baseline"][-3:] == [
        "--json-model-override-args", '{"rope": 1}', "--x"]
    bad = _cli("--eagle-kv-tokens", "200000", "--eagle-extra-args=--x 'unclosed")
    assert bad.returncode == 2 and "--eagle-extra-args" in bad.stderr


def test_cli_version_0_5_10_uses_its_flag_name_and_reserve() -> None:
    done = _cli("--eagle-kv-tokens", "200000", "--json", "--sglang-version", "0.5.10")
    data = json.loads(done.stdout)
    assert "--cuda-graph-max-bs" in data["flags"]["eagle"]
    assert data["servers"][0]["headroom_gib"] == pytest.approx(13.17 + 4, abs=0.01)


def test_cli_verbatim_args_follow_the_split_ones() -> None:
    done = _cli("--eagle-kv-tokens", "200000", "--json", "--eagle-extra-args=--a 1",
                "--eagle-arg=--json-model-override-args", "--eagle-arg={\"x\": \"it's\"}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["flags"]["eagle"][-4:] == [
        "--a", "1", "--json-model-override-args", '{"x": "it\'s"}']
