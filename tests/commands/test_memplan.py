"""The planner against SGLang's memory rule, replayed on a simulated GPU ledger.

`SimulatedGpu` is written from SGLang's code, independently of the planner: each process
takes its CUDA context, measures free memory (`total`), loads weights, and sizes its KV pool
as `rest = (total - weights) - total * (1 - fraction)`; later it uses its headroom.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from specrouter.commands.memplan import (
    GIB,
    PRESETS,
    PlanError,
    PlanInput,
    ServerWant,
    kv_tokens_for,
    plan_pair,
)

LLAMA_BPT = PRESETS["llama3-8b"].bytes_per_token()
LLAMA_DRAFT_BPT = PRESETS["llama3-8b"].bytes_per_token(layers=1)


@dataclass
class SimulatedGpu:
    free_gib: float

    def start_sglang(self, ctx: float, fraction: float, weights: float, bpt: int) -> int:
        self.free_gib -= ctx
        total = self.free_gib  # get_available_gpu_memory() at start
        self.free_gib -= weights
        rest = self.free_gib - total * (1 - fraction)
        assert rest > 0, "SGLang: Not enough memory. Please try to increase --mem-fraction-static"
        tokens = int(rest * GIB) // bpt
        self.free_gib -= tokens * bpt / GIB
        return tokens

    def run_with_headroom(self, headroom: float) -> None:
        self.free_gib -= headroom
        assert self.free_gib >= 0, f"out of memory by {-self.free_gib:.2f} GiB"


def pair(gpu: float = 139.8, eagle_kv: int | None = 200_000, base_kv: int | None = None,
         headroom: float = 6.0, first: str = "eagle", model: float = 14.96,
         draft: float = 0.8) -> PlanInput:
    return PlanInput(
        gpu_free_gib=gpu,
        eagle=ServerWant("eagle", model + draft, LLAMA_BPT + LLAMA_DRAFT_BPT, eagle_kv, headroom),
        baseline=ServerWant("baseline", model, LLAMA_BPT, base_kv, headroom),
        first=first,  # type: ignore[arg-type]
        cuda_context_gib=0.5,
    )


def replay(spec: PlanInput) -> dict[str, int]:
    """Start both servers in the planned order on a fresh simulated GPU; KV tokens each."""
    plan = plan_pair(spec)
    gpu = SimulatedGpu(spec.gpu_free_gib)
    tokens = {}
    for server in plan.servers:
        want = spec.eagle if server.role == "eagle" else spec.baseline
        tokens[server.role] = gpu.start_sglang(
            spec.cuda_context_gib, server.mem_fraction_static, want.weights_gib,
            want.kv_bytes_per_token,
        )
        gpu.run_with_headroom(want.headroom_gib)
        assert server.kv_tokens == tokens[server.role]
        assert server.reserved_gib + 1e-3 >= want.headroom_gib
    assert gpu.free_gib == pytest.approx(plan.unused_gib, abs=2e-3)
    return tokens


def test_llama_shapes_match_config_json() -> None:
    # 2 (K,V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes (bf16)
    assert LLAMA_BPT == 131_072
    assert LLAMA_DRAFT_BPT == 4_096
    assert PRESETS["qwen3-32b"].bytes_per_token() == 2 * 64 * 8 * 128 * 2


def test_eagle_first_then_baseline_fills_the_rest() -> None:
    tokens = replay(pair())
    assert tokens["eagle"] >= 200_000
    assert tokens["eagle"] < 200_000 * 1.01  # rounding of the fraction costs < 1%
    assert tokens["baseline"] > 500_000  # the 8B baseline gets the rest of an H200


def test_second_server_fraction_is_of_what_the_first_left() -> None:
    plan = plan_pair(pair())
    eagle, baseline = plan.servers
    # The same fraction against the whole GPU would be a gross overcommit.
    assert baseline.free_at_start_gib < plan.gpu_free_gib - 40
    assert baseline.mem_fraction_static * baseline.free_at_start_gib < (
        plan.gpu_free_gib - eagle.weights_gib - eagle.kv_pool_gib
    )


def test_baseline_first_with_both_budgets_fixed() -> None:
    tokens = replay(pair(first="baseline", eagle_kv=150_000, base_kv=400_000))
    assert 400_000 <= tokens["baseline"] < 404_000
    assert 150_000 <= tokens["eagle"] < 152_000


def test_small_gpu_fits_with_small_budgets() -> None:
    tokens = replay(pair(gpu=79.2, eagle_kv=100_000, base_kv=150_000, headroom=4.0))
    assert tokens["eagle"] >= 100_000 and tokens["baseline"] >= 150_000


def test_kv_tokens_for_is_sglang_formula() -> None:
    # total 100 GiB, weights 20, fraction 0.5: rest = 80 - 50 = 30 GiB
    assert kv_tokens_for(100.0, 0.5, 20.0, 1 << 20) == 30 * 1024


def test_refuses_first_server_that_does_not_fit() -> None:
    with pytest.raises(PlanError, match=r"eagle server \(starts first\).*short by 55.56 GiB"):
        plan_pair(pair(gpu=80, eagle_kv=900_000))


def test_refuses_second_server_and_blames_the_first() -> None:
    with pytest.raises(PlanError) as info:
        plan_pair(pair(eagle_kv=600_000, base_kv=400_000))
    message = str(info.value)
    assert "baseline server (starts second)" in message
    assert "short by" in message and "the eagle server, started first, holds" in message


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
    assert eagle["role"] == "eagle" and eagle["kv_tokens"] >= 200_000
    flags = data["flags"]["eagle"]
    assert flags[flags.index("--mem-fraction-static") + 1] == str(eagle["mem_fraction_static"])
    for flag in ("--speculative-algorithm", "--speculative-draft-model-path",
                 "--speculative-num-steps", "--speculative-eagle-topk",
                 "--speculative-num-draft-tokens", "--enable-metrics", "--max-running-requests"):
        assert flag in flags
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
