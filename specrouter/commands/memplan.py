"""Memory plan for two SGLang servers on one GPU: pure arithmetic, no I/O.

SGLang's rule (`profile_available_bytes` in `sglang/srt/model_executor/pool_configurator.py`
on main, `ModelRunner.profile_max_num_token` in 0.5.x; the same formula in both):

    total  = free GPU memory measured when the process starts (after its CUDA context)
    avail  = free GPU memory after the weights are loaded   (= total - weights)
    rest   = avail - total * (1 - mem_fraction_static)        -> the KV pool, in bytes
    tokens = rest // bytes_per_token

so `mem_fraction_static * total` is what the process keeps for weights + KV pool, and
`total * (1 - mem_fraction_static)` is left free for activations and CUDA graphs. Because
`total` is what is free *when that process starts*, the second server of a pair sees only
what the first left: its fraction must be computed against that, not the GPU's size.
For an EAGLE server the draft model's weights count as weights, and the draft's KV layers
enlarge the per-token cost: SGLang scales the cell size by (1 + draft_layers / layers).

Everything is in bytes internally; GiB (2**30) at the edges, like SGLang's logs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

GIB = 1 << 30
Role = Literal["eagle", "baseline"]
FRACTION_DECIMALS = 3  # SGLang logs two decimals; three keeps the rounding loss small


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
class ServerWant:
    """What one server needs: weights, KV tokens (None: all that is left) and headroom."""

    role: Role
    weights_gib: float
    kv_bytes_per_token: int
    kv_tokens: int | None
    headroom_gib: float


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
    free_at_start_gib: float
    mem_fraction_static: float
    weights_gib: float
    kv_pool_gib: float
    kv_tokens: int
    reserved_gib: float  # total * (1 - fraction): left free for activations and CUDA graphs
    headroom_gib: float


@dataclass(frozen=True)
class Plan:
    servers: tuple[ServerPlan, ServerPlan]
    gpu_free_gib: float
    unused_gib: float  # free after both are up and using their headroom
    notes: list[str] = field(default_factory=list)

    def by_role(self, role: Role) -> ServerPlan:
        return next(s for s in self.servers if s.role == role)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PlanError(ValueError):
    """A plan that does not fit; the message names the budget and the shortfall."""


def kv_tokens_for(free_gib: float, fraction: float, weights_gib: float, bpt: int) -> int:
    """SGLang's formula, as it computes the pool: int(rest_gib * 2**30) // cell_size."""
    available_after_load = free_gib - weights_gib
    rest_gib = available_after_load - free_gib * (1 - fraction)
    return max(int(rest_gib * GIB) // bpt, 0)


def _fraction_for(free_gib: float, want: ServerWant) -> float:
    """Smallest fraction (rounded up) that gives `want.kv_tokens`, or all but the headroom."""
    scale = 10**FRACTION_DECIMALS
    if want.kv_tokens is None:
        return float(math.floor((1 - want.headroom_gib / free_gib) * scale) / scale)
    static_gib = want.weights_gib + want.kv_tokens * want.kv_bytes_per_token / GIB
    return float(math.ceil(static_gib / free_gib * scale) / scale)


def _plan_one(order: int, free_gib: float, want: ServerWant) -> ServerPlan:
    name = f"{want.role} server (starts {'first' if order == 1 else 'second'})"
    if free_gib <= 0:
        raise PlanError(f"{name}: no GPU memory left when it starts ({free_gib:.2f} GiB free)")
    fraction = _fraction_for(free_gib, want)
    kv_tokens = kv_tokens_for(free_gib, fraction, want.weights_gib, want.kv_bytes_per_token)
    reserved = free_gib * (1 - fraction)
    needed = want.weights_gib + want.headroom_gib + (
        (want.kv_tokens or 1) * want.kv_bytes_per_token / GIB
    )
    if fraction >= 1 or reserved < want.headroom_gib or kv_tokens <= 0:
        what = (
            f"{want.kv_tokens} KV tokens" if want.kv_tokens is not None else "any KV pool"
        )
        raise PlanError(
            f"{name}: weights {want.weights_gib:.2f} GiB + {what} + headroom "
            f"{want.headroom_gib:.2f} GiB need {needed:.2f} GiB, but only {free_gib:.2f} GiB "
            f"is free when it starts: short by {needed - free_gib:.2f} GiB"
        )
    return ServerPlan(
        role=want.role,
        order=order,
        free_at_start_gib=round(free_gib, 3),
        mem_fraction_static=fraction,
        weights_gib=want.weights_gib,
        kv_pool_gib=round(kv_tokens * want.kv_bytes_per_token / GIB, 3),
        kv_tokens=kv_tokens,
        reserved_gib=round(reserved, 3),
        headroom_gib=want.headroom_gib,
    )


def plan_pair(spec: PlanInput) -> Plan:
    """Fractions for both servers, the first sized on the idle GPU, the second on what is left.

    What the first leaves = its free-at-start minus its static part (weights + KV) minus the
    headroom it will actually use (activations, CUDA graphs); the second then loses its own
    CUDA context before it measures. Raises PlanError when either does not fit.
    """
    first, second = (
        (spec.eagle, spec.baseline) if spec.first == "eagle" else (spec.baseline, spec.eagle)
    )
    if first.kv_tokens is None:
        raise PlanError(f"the {first.role} server starts first: give its KV tokens")
    free1 = spec.gpu_free_gib - spec.cuda_context_gib
    plan1 = _plan_one(1, free1, first)
    static1 = first.weights_gib + plan1.kv_tokens * first.kv_bytes_per_token / GIB
    left_by_first = free1 - static1 - first.headroom_gib
    free2 = left_by_first - spec.cuda_context_gib
    try:
        plan2 = _plan_one(2, free2, second)
    except PlanError as exc:
        raise PlanError(
            f"{exc} (the {first.role} server, started first, holds "
            f"{spec.cuda_context_gib + static1 + first.headroom_gib:.2f} GiB of "
            f"{spec.gpu_free_gib:.2f} GiB: lower its KV tokens or headroom)"
        ) from None
    static2 = second.weights_gib + plan2.kv_tokens * second.kv_bytes_per_token / GIB
    unused = free2 - static2 - second.headroom_gib
    notes = []
    if second.kv_tokens is None:
        notes.append(f"the {second.role} server takes all memory left but its headroom")
    return Plan(
        servers=(plan1, plan2),
        gpu_free_gib=spec.gpu_free_gib,
        unused_gib=round(unused, 3),
        notes=notes,
    )
