"""The parametric step costs behind the `seed-coding` profile, and the writer of its table.

Only the reference deployment's end-to-end throughputs are known (GUIDE.md section 3), so
its step costs are a formula whose sweep (`python -m specrouter.sim.sweep`) meets those
targets (docs/simulator.md). The formula lives here so the shipped `seed-coding-steps.jsonl`
can be regenerated and checked: `python -m specrouter.sim.seedfit` rewrites it.
"""

from __future__ import annotations

import json

from specrouter.sim.profile import PROFILE_DIR

BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)
CTXS = (1024, 8192)
TABLE = PROFILE_DIR / "seed-coding-steps.jsonl"


def decode_ms(batch: int, ctx: int) -> float:
    """20 ms fixed (weights) + ~0.9 ms per request at ~1.1k context."""
    return 20.0 + batch * (0.57 + 0.30 * ctx / 1024)


def verify4_ms(batch: int, ctx: int) -> float:
    """Verify over 4 draft tokens: B=1 sets the concurrency-1 gain, the steep B=1->2 step
    makes the baseline win from concurrency 2, the slope sets concurrency-64 throughput."""
    if batch <= 1:
        return 32.8
    if batch <= 2:
        return 32.8 + (batch - 1) * 8.7
    return 41.5 + (batch - 2) * (3.97 + 0.30 * ctx / 1024)


def draft_ms(batch: int, ctx: int) -> float:
    return 1.5 + 0.02 * batch


def rows() -> list[dict[str, object]]:
    return [{"model": "seed-coding", "batch": b, "ctx": ctx,
             "target_q1_ms": round(decode_ms(b, ctx), 3),
             "target_q4_ms": round(verify4_ms(b, ctx), 3),
             "draft_step_ms": round(draft_ms(b, ctx), 3)}
            for ctx in CTXS for b in BATCHES]


def render() -> str:
    return "".join(json.dumps(r) + "\n" for r in rows())


if __name__ == "__main__":
    TABLE.write_text(render())
