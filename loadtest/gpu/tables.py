"""Turn raw stepcost.py output (docs/gpu-raw/run2/*.jsonl) into simulator step tables.

Why a separate step: the raw rows carry one column per attention path (target_q4_triton_ms, ...)
and rows for batches that did not fit in memory; the simulator's loader reads every
``target_q*_ms`` column as a verify width, so the tables keep only the fastest path per step
(``target_qN_ms``, with the path named in ``attn_qN``), the floors, and the draft steps.

Run: python3 loadtest/gpu/tables.py docs/gpu-raw/run2 specrouter/sim/profiles
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

QS = (1, 4, 8, 16)


def table_row(raw: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"model": raw["model"], "batch": raw["batch"], "ctx": raw["ctx"]}
    for q in QS:
        row[f"target_q{q}_ms"] = raw[f"target_q{q}_ms"]
        row[f"floor_q{q}_ms"] = raw[f"floor_q{q}_ms"]
        row[f"floor_seq_q{q}_ms"] = raw[f"floor_seq_q{q}_ms"]
        row[f"attn_q{q}"] = raw[f"attn_q{q}"]
    row["draft_step_ms"] = raw["draft_step_ms"]  # topk-4 draft step over B x 4 tokens
    row["draft_chain_step_ms"] = raw["draft_q1_step_ms"]  # topk-1 (chain) draft step, B tokens
    row["source"] = "h200 stepcost.py run2 2026-12-02"
    return row


def main(raw_dir: str, out_dir: str) -> int:
    by_model: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(raw_dir).glob("*-ctx*.jsonl")):
        if "generic" in path.name:
            continue
        for line in path.read_text().splitlines():
            raw = json.loads(line)
            if "skipped" in raw:
                continue
            by_model.setdefault(raw["model"], []).append(table_row(raw))
    for model, rows in by_model.items():
        rows.sort(key=lambda r: (r["ctx"], r["batch"]))
        dst = Path(out_dir) / f"h200-{model}-measured.jsonl"
        dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{dst}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
