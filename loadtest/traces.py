"""Phased traces as data: built-in ones, or a JSON file of the same shape.

A trace file is `{"name": ..., "phases": [{"name", "duration_s", "concurrency" | "rate",
"control"?}, ...]}` or just the list of phases. Durations and rates are in simulated
seconds; `control` is sent to every simulated EAGLE engine (POST /sim/control) when the
phase starts, e.g. `{"accept_length": 1.6}` to shift the workload mid-run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.generator import Phase

BUILTIN: dict[str, list[dict[str, Any]]] = {
    # Light load, a burst that only the baseline pool serves well, light load again.
    "burst": [
        {"name": "low", "duration_s": 60, "concurrency": 2},
        {"name": "burst", "duration_s": 90, "concurrency": 48},
        {"name": "low-again", "duration_s": 60, "concurrency": 2},
    ],
    # Steady moderate load; the EAGLE engine's accept length drops (chat-like traffic
    # replacing code) and recovers: the load at which the baseline wins moves with it.
    "accept-shift": [
        {"name": "accept-3.0", "duration_s": 60, "concurrency": 8,
         "control": {"accept_length": 3.0}},
        {"name": "accept-1.6", "duration_s": 60, "concurrency": 8,
         "control": {"accept_length": 1.6}},
        {"name": "accept-3.0-again", "duration_s": 60, "concurrency": 8,
         "control": {"accept_length": 3.0}},
    ],
    # Open loop on h200-llama3-8b (see docs/benchmarks.md for how the rates were chosen):
    # 3 req/s keeps about 2-3 requests in the group (EAGLE-3's regime); 17 req/s is above
    # what EAGLE-3 alone can serve (~14 req/s with prefill, batch capped at 48) and below
    # what the baseline serves (~19 req/s at large batches).
    "burst-open": [
        {"name": "low", "duration_s": 30, "rate": 3.0},
        {"name": "burst", "duration_s": 60, "rate": 17.0},
        {"name": "low-again", "duration_s": 60, "rate": 3.0},
    ],
    # The accept-length shift at a steady 24 users on h200-llama3-8b: at accept 3.0
    # EAGLE-3 serves 24 users ~1.5x better than the baseline, at 1.6 the baseline is
    # ~1.2x better (cost model of the profile: crossover 61.6 at 3.0, 12.4 at 1.6).
    "accept-shift-c24": [
        {"name": "accept-3.0", "duration_s": 40, "concurrency": 24,
         "control": {"accept_length": 3.0}},
        {"name": "accept-1.6", "duration_s": 40, "concurrency": 24,
         "control": {"accept_length": 1.6}},
        {"name": "accept-3.0-again", "duration_s": 40, "concurrency": 24,
         "control": {"accept_length": 3.0}},
    ],
}


def parse_trace(raw: Any) -> list[Phase]:
    rows = raw.get("phases") if isinstance(raw, dict) else raw
    if not isinstance(rows, list) or not rows:
        raise ValueError("a trace is a non-empty list of phases (or {'phases': [...]})")
    phases = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"phase {i}: expected an object")
        phases.append(Phase.from_dict({"name": f"phase{i}", **row}))
    return phases


def load_trace(name_or_path: str) -> list[Phase]:
    """A built-in trace by name, or a JSON file."""
    if name_or_path in BUILTIN:
        return parse_trace(BUILTIN[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown trace {name_or_path!r}: built-ins are "
                         f"{', '.join(sorted(BUILTIN))}, or give a JSON file")
    return parse_trace(json.loads(path.read_text(encoding="utf-8")))


def scaled(phases: list[Phase], factor: float) -> list[Phase]:
    """The same trace with every phase `factor` times as long (quick runs)."""
    return [Phase(p.name, p.duration_s * factor, p.concurrency, p.rate, p.control)
            for p in phases]
