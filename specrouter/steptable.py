"""The step-cost table: measured decode-step costs, one JSON object a line.

The format of shared/calibration/*.jsonl, read by the router's cost model and by the
simulator alike: each row holds an integer `batch`, an integer `ctx` (a table measured at
one context length may leave it out: 0), `target_q1_ms` (one decode step of the target
model) and optional columns `target_qN_ms` (a verify step over N tokens) and
`draft_step_ms`.
"""

from __future__ import annotations

import json
from typing import Any

StepRow = dict[str, Any]


def parse_step_table(text: str, source: str = "step table") -> list[StepRow]:
    """The rows of a step-cost table; blank lines are skipped. Raises ValueError naming
    `source` and the line of the first malformed row."""
    rows: list[StepRow] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source} line {lineno}: not JSON ({exc.msg})") from None
        rows.append(_checked(row, f"{source} line {lineno}"))
    if not rows:
        raise ValueError(f"{source} is empty")
    return rows


def _checked(row: Any, where: str) -> StepRow:
    if not isinstance(row, dict) or "batch" not in row or "target_q1_ms" not in row:
        raise ValueError(f"{where}: needs 'batch' and 'target_q1_ms'")
    if not _is_int(row["batch"]) or not _is_int(row.get("ctx", 0)):
        raise ValueError(f"{where}: 'batch' and 'ctx' must be integers")
    return {**row, "ctx": row.get("ctx", 0)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
