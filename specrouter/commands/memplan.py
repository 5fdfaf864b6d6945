"""Memory plan for two SGLang servers on one GPU: pure arithmetic, no I/O.

How SGLang sizes a server's memory (read in SGLang 0.5.23 and 0.5.10):

    total  = free GPU memory when the process starts (device-wide, after its CUDA context)
    avail  = free GPU memory once the weights are loaded
    rest   = avail - total * (1 - mem_fraction_static)      -> the KV pool, in bytes
    tokens = min(rest // bytes_per_token, --max-total-tokens)

(0.5.23: `KVCacheConfigurator._profile_available_bytes` and `_apply_token_constraints`,
`mem_cache/kv_cache_configurator.py`; 0.5.10: `ModelRunner.profile_max_num_token`.)
Activations are allocated lazily, once the server serves: the second server of a pair,
started when the first is ready, sees the first one's unused activation headroom as free
and would take it as KV pool, then both run out of memory at their first peaks. So every
server's pool is capped with `--max-total-tokens`, and the second server's fraction is sized
against the memory it finds when the first already holds its whole headroom: a larger
`total` then yields a larger `rest`, which the cap discards.

The EAGLE-3 draft's weights: 0.5.23 loads them before it profiles the pool (inside the
fraction, `Scheduler.init_model_worker`), 0.5.10 after (outside it). The fraction is sized
with the draft inside, so the capped pool is reached under both; the memory the server
holds is the same either way: target + draft weights + pool + headroom.

The headroom is SGLang's own reserve rule (`_handle_gpu_memory_settings`, 0.5.23
`arg_groups/memory_hook.py`; 0.5.10 `server_args.py`), fed with the chunked prefill size
and the decode CUDA graph batch size that the plan pins in each server's flags, so the
activations and graphs it covers are bounded by what the server is told to run.

Everything is in bytes internally; GiB (2**30) at the edges, like SGLang's logs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

GIB = 1 << 30
MIB_PER_GIB = 1024
Role = Literal["eagle", "baseline"]
SglangVersion = Literal["0.5.23", "0.5.10"]
SGLANG_VERSIONS: tuple[SglangVersion, ...] = ("0.5.23", "0.5.10")
FRACTION_DECIMALS = 3  # SGLang's own rule rounds to three decimals too


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that fixes KV bytes per token: 2 (K and V) * layers * heads * dim."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def bytes_per_token(self, layers: int | None = None) -> int:
        n_layers = self.layers if layers is None else layers
        return 2 * n_layers * self.kv_heads * self.head_dim * self.dtype_bytes


# Shapes from the models' config.json (num_hidden_layers, num_key_value_heads, head_dim), bf16.
PRESETS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(layers=32, kv_heads=8, head_dim=128),
    "llama3-70b": ModelShape(layers=80, kv_heads=8, head_dim=128),
    "qwen3-8b": ModelShape(layers=36, kv_heads=8, head_dim=128),
    "qwen3-32b": ModelShape(layers=64, kv_heads=8, head_dim=128),
}


@dataclass(frozen=True)
class Workspace:
    """The flags that bound a server's activations and CUDA graphs, pinned in its command."""

    chunked_prefill_size: int
    cuda_graph_max_bs: int


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts SGLang 0.5.23 captures prefill CUDA graphs for (its default list)."""
    sizes = (
        list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
        + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]


def sglang_reserve_gib(gpu_gib: float, workspace: Workspace, speculative: bool,
                       version: SglangVersion = "0.5.23", tp_size: int = 1) -> float:
    """What SGLang leaves outside its static memory for one server, in GiB (tp=pp=1, no DP
    attention, not MLA, not disaggregated: the pair's case).

    512 MiB of constant buffers + 1.5 MiB per chunked-prefill token (at least 2048 tokens)
    + tp/8 GiB + 2 MiB per decode CUDA-graph batch size + 8 MiB per captured prefill graph,
    at least 10 GiB on a GPU over 60 GiB; 0.5.10 adds 4 GiB for an EAGLE draft.
    """
    mib = 512.0
    mib += max(workspace.chunked_prefill_size, 2048) * 1.5
    mib += tp_size / 8 * 1024
    mib += workspace.cuda_graph_max_bs * 2
    mib += len(prefill_graph_sizes(workspace.chunked_prefill_size)) * 8
    if gpu_gib > 60:
        mib = max(mib, 10 * 1024.0)
    if version == "0.5.10" and speculative:
        mib += 4 * 1024
    return mib / MIB_PER_GIB


@dataclass(frozen=True)
class ServerWant:
    """What one server needs: weights (target; draft for EAGLE), KV tokens (None: all that
    is left, only for the server that starts second) and its headroom."""

    role: Role
    weights_gib: float
    kv_bytes_per_token: int
    kv_tokens: int | None
    headroom_gib: float
    draft_gib: float = 0.0


@dataclass(frozen=True)
class PlanInput:
    gpu_free_gib: float  # free on the idle GPU before either server starts
    eagle: ServerWant
    baseline: ServerWant
    first: Role = "eagle"
    cuda_context_gib: float = 0.52  # each process's CUDA context, taken before it measures


@dataclass(frozen=True)
class ServerPlan:
    role: Role
    order: int
    free_at_start_gib: float  # the least it can find: the other server at its peak
    mem_fraction_static: float
    max_total_tokens: int  # the pool's cap; the KV pool is exactly this many tokens
    kv_bytes_per_token: int
    weights_gib: float
    draft_gib: float
    kv_pool_gib: float
    headroom_gib: float
    peak_gib: float  # CUDA context + weights + draft + pool + headroom


@dataclass(frozen=True)
class Plan:
    servers: tuple[ServerPlan, ServerPlan]
    gpu_free_gib: float
    unused_gib: float  # free with both servers at their peaks
    notes: list[str] = field(default_factory=list)

    def by_role(self, role: Role) -> ServerPlan:
        return next(s for s in self.servers if s.role == role)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PlanError(ValueError):
    """A plan that does not fit; the message names the budget and the shortfall."""


def kv_tokens_for(free_gib: float, fraction: float, weights_gib: float, bpt: int,
                  cap: int | None = None) -> int:
    """SGLang's formula as it sizes the pool: int(rest_gib * 2**30) // cell, then the cap.
    `weights_gib` is what is resident when the pool is profiled."""
    rest_gib = (free_gib - weights_gib) - free_gib * (1 - fraction)
    tokens = max(int(rest_gib * GIB) // bpt, 0)
    return tokens if cap is None else min(tokens, cap)


def _fraction_for(free_gib: float, static_gib: float) -> float:
    """Smallest fraction (rounded up to SGLang's precision) whose budget holds `static_gib`."""
    scale = 10**FRACTION_DECIMALS
    return float(math.ceil(static_gib / free_gib * scale) / scale)


def _pool_gib(tokens: int, bpt: int) -> float:
    return tokens * bpt / GIB


def _plan_one(order: int, free_gib: float, want: ServerWant, context_gib: float) -> ServerPlan:
    name = f"{want.role} server (starts {'first' if order == 1 else 'second'})"
    if free_gib <= 0:
        raise PlanError(f"{name}: no GPU memory left when it starts ({free_gib:.2f} GiB free)")
    weights = want.weights_gib + want.draft_gib
    if want.kv_tokens is None:
        tokens = int((free_gib - weights - want.headroom_gib) * GIB) // want.kv_bytes_per_token
        what = "any KV pool"
    else:
        tokens = want.kv_tokens
        what = f"{want.kv_tokens} KV tokens"
    needed = weights + want.headroom_gib + _pool_gib(max(tokens, 1), want.kv_bytes_per_token)
    if tokens <= 0 or needed > free_gib:
        raise PlanError(
            f"{name}: weights {weights:.2f} GiB + {what} + headroom "
            f"{want.headroom_gib:.2f} GiB need {needed:.2f} GiB, but only {free_gib:.2f} GiB "
            f"is free when it starts: short by {needed - free_gib:.2f} GiB"
        )
    fraction = _fraction_for(free_gib, weights + _pool_gib(tokens, want.kv_bytes_per_token))
    pool = _pool_gib(tokens, want.kv_bytes_per_token)
    return ServerPlan(
        role=want.role,
        order=order,
        free_at_start_gib=round(free_gib, 3),
        mem_fraction_static=fraction,
        max_total_tokens=tokens,
        kv_bytes_per_token=want.kv_bytes_per_token,
        weights_gib=want.weights_gib,
        draft_gib=want.draft_gib,
        kv_pool_gib=round(pool, 3),
        headroom_gib=round(want.headroom_gib, 3),
        peak_gib=round(context_gib + weights + pool + want.headroom_gib, 3),
    )


def plan_pair(spec: PlanInput) -> Plan:
    """Fractions and pool caps for both servers, the first sized on the idle GPU, the second
    on what is left when the first is at its peak. Raises PlanError when either does not fit.
    """
    first, second = (
        (spec.eagle, spec.baseline) if spec.first == "eagle" else (spec.baseline, spec.eagle)
    )
    if first.kv_tokens is None:
        raise PlanError(f"the {first.role} server starts first: give its KV tokens")
    ctx = spec.cuda_context_gib
    plan1 = _plan_one(1, spec.gpu_free_gib - ctx, first, ctx)
    free2 = spec.gpu_free_gib - plan1.peak_gib - ctx
    try:
        plan2 = _plan_one(2, free2, second, ctx)
    except PlanError as exc:
        raise PlanError(
            f"{exc} (the {first.role} server, started first, holds up to "
            f"{plan1.peak_gib:.2f} GiB of {spec.gpu_free_gib:.2f} GiB: lower its KV tokens "
            "or its workspace)"
        ) from None
    unused = spec.gpu_free_gib - plan1.peak_gib - plan2.peak_gib
    notes = [
        "each server's KV pool is also its prefix-cache capacity: the radix cache keeps "
        "finished prefixes in the same pool until it needs the room",
    ]
    if second.kv_tokens is None:
        notes.append(f"the {second.role} server takes all memory left but its headroom")
    return Plan(
        servers=(plan1, plan2),
        gpu_free_gib=spec.gpu_free_gib,
        unused_gib=round(unused, 3),
        notes=notes,
    )
