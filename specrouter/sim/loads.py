"""GET /v1/loads as each SGLang release renders it.

0.5.23 (entrypoints/v1_loads.py:95-150, managers/load_snapshot.py:196-264): the snapshot the
scheduler last published (every 15 decode batches, every prefill batch, and continuously while
idle), each rank
with its own `timestamp` on the server clock and every core scalar (None ones as null); the top
level carries `accelerator` and `num_accelerators`; `loads` is empty when the snapshot reader is
not attached. 0.5.10 (v1_loads.py:130-175, observability/scheduler_metrics_mixin.py): answered
live; None fields and `timestamp` are dropped, and so is `dp_rank` on a server without data
parallelism (its scheduler's dp_rank is None), so `?dp_rank=0` matches nothing there; the top
level carries `dp_rank_count` and `aggregate`.
"""

from __future__ import annotations

import datetime
from typing import Any

from specrouter.sim.engine import Engine, Snapshot
from specrouter.sim.version import SglangVersion

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
KV_BYTES_PER_TOKEN = 131072  # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x (K,V) x bf16
ACCELERATOR = "NVIDIA H200"


class LoadsError(ValueError):
    """The query is invalid; `status` is what this release answers."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def render(engine: Engine, version: SglangVersion, include_raw: str | None,
           dp_rank_raw: str | None, reader_attached: bool) -> dict[str, Any]:
    include = ({s.strip() for s in include_raw.split(",")} if include_raw else None)
    dp_rank = _dp_rank(dp_rank_raw)
    if version.loads_from_snapshot:
        return _render_snapshot(engine, version, include, dp_rank, reader_attached)
    return _render_live(engine, version, include, dp_rank)


def _dp_rank(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LoadsError("dp_rank: Input should be a valid integer, unable to parse string "
                         "as an integer", 400) from None


def _invalid(include: set[str]) -> str:
    return (f"Invalid include sections: {include - SECTIONS}. "
            f"Valid options: {sorted(SECTIONS)}")


def _render_snapshot(engine: Engine, version: SglangVersion, include: set[str] | None,
                     dp_rank: int | None, reader_attached: bool) -> dict[str, Any]:
    engine.refresh_idle_snapshot()
    snaps = [engine.loads] if reader_attached and engine.publishes and dp_rank in (None, 0) \
        else []
    if include is not None and not include <= SECTIONS and snaps:
        # raised by LoadSnapshot.to_dict outside the route's try: an unhandled error
        raise LoadsError(_invalid(include), 500)
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": version.name, "accelerator": ACCELERATOR, "num_accelerators": 1,
        "loads": [_snapshot_entry(engine, s, include) for s in snaps],
    }


def _core(engine: Engine, snap: Snapshot) -> dict[str, Any]:
    cap, limit = engine.limits.kv_capacity_tokens, engine.limits.max_running_requests
    return {
        "num_running_reqs": snap.num_running_reqs, "num_waiting_reqs": snap.num_waiting_reqs,
        "num_used_tokens": snap.num_used_tokens, "max_total_num_tokens": cap,
        "token_usage": round(snap.num_used_tokens / cap, 4),
        "gen_throughput": round(snap.gen_throughput, 2),
        "cache_hit_rate": round(snap.cache_hit_rate, 4),
        "utilization": round(snap.num_running_reqs / limit, 4),
        "max_running_requests": limit,
    }


def _sections(engine: Engine, snap: Snapshot, with_prealloc: bool) -> dict[str, Any]:
    cap = engine.limits.kv_capacity_tokens
    out: dict[str, Any] = {"memory": {
        "weight_gb": 16.06, "kv_cache_gb": round(cap * KV_BYTES_PER_TOKEN / 2**30, 3),
        "graph_gb": 0.5, "token_capacity": cap}}
    if engine.is_eagle and snap.accept_length > 0:  # absent before the first 40-batch fold
        out["speculative"] = {"accept_length": snap.accept_length,
                              "accept_rate": snap.window_accept_rate}
    out["disaggregation"] = {
        "mode": "null", "prefill_bootstrap_queue_reqs" if with_prealloc
        else "prefill_prealloc_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0}
    queues = {"waiting": snap.num_waiting_reqs, "grammar": 0, "paused": 0, "retracted": 0}
    if with_prealloc:
        queues["prealloc_ready"] = 0
    out["queues"] = queues
    return out


_SECTION_NAMES = {"memory": "memory", "speculative": "spec", "lora": "lora",
                  "disaggregation": "disagg", "queues": "queues"}


def _wanted(sections: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    if include is None or "all" in include:
        return sections
    return {k: v for k, v in sections.items() if _SECTION_NAMES[k] in include}


def _snapshot_entry(engine: Engine, snap: Snapshot, include: set[str] | None
                    ) -> dict[str, Any]:
    core = _core(engine, snap)
    total = snap.num_used_tokens + snap.num_waiting_tokens
    entry: dict[str, Any] = {
        "timestamp": snap.timestamp, "dp_rank": 0,
        "num_running_reqs": core["num_running_reqs"],
        "num_waiting_reqs": core["num_waiting_reqs"],
        "num_waiting_uncached_tokens": snap.num_waiting_uncached_tokens,
        "num_used_tokens": core["num_used_tokens"], "num_total_tokens": total,
        "num_active_tokens": total, "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": core["max_total_num_tokens"],
        "max_running_requests": core["max_running_requests"],
        "token_usage": core["token_usage"], "gen_throughput": core["gen_throughput"],
        "cache_hit_rate": core["cache_hit_rate"], "utilization": core["utilization"],
        "total_prefill_uncached_tokens": snap.prefill_tokens,
        "total_prefill_busy_us": snap.prefill_busy_us, "decode_moments": None,
    }
    if include == {"core"}:
        return entry
    entry.update(_wanted(_sections(engine, snap, with_prealloc=True), include))
    return entry


def _render_live(engine: Engine, version: SglangVersion, include: set[str] | None,
                 dp_rank: int | None) -> dict[str, Any]:
    if include is not None and not include <= SECTIONS:
        raise LoadsError(_invalid(include), 400)
    # the scheduler's dp_rank is None without data parallelism: a dp_rank filter drops it
    loads = [] if dp_rank is not None else [_live_entry(engine, include)]
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": version.name, "dp_rank_count": len(loads), "loads": loads,
        "aggregate": _aggregate(loads),
    }


def _live_entry(engine: Engine, include: set[str] | None) -> dict[str, Any]:
    snap = engine.live_snapshot()
    entry = _core(engine, snap)
    entry.update(_wanted(_sections(engine, snap, with_prealloc=False), include or {"all"}))
    entry["num_total_reqs"] = entry["num_running_reqs"] + entry["num_waiting_reqs"]
    return entry


def _aggregate(loads: list[dict[str, Any]]) -> dict[str, Any]:
    if not loads:
        return {"total_running_reqs": 0, "total_waiting_reqs": 0, "total_reqs": 0,
                "avg_token_usage": 0.0, "avg_throughput": 0.0, "avg_utilization": 0.0}
    n = len(loads)
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
        "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
    }
