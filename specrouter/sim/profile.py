"""Simulator profiles: the numbers that make one simulated deployment behave like another.

A profile is a small JSON file; its step costs come from a JSON-lines table in the format of
shared/calibration/*.jsonl (`model, batch, ctx, target_qN_ms, draft_step_ms`), so GPU
measurements drop in unchanged. Loading is pure (no I/O besides reading the files) and every
bad field is reported by name, because a silently wrong profile makes every benchmark wrong.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrouter.steptable import parse_step_table

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(ValueError):
    """A profile or step table is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class StepTable:
    """Measured step costs on a (batch, ctx) grid, bilinearly interpolated.

    Outside the grid the cost is extrapolated linearly in batch (decode cost grows about
    linearly with batch once compute-bound) and clamped in ctx, which errs on the side of the
    measured data rather than inventing a trend.
    """

    batches: tuple[int, ...]
    ctxs: tuple[int, ...]
    # cost[column][ctx_index][batch_index]; columns "target_q1_ms", ..., "draft_step_ms"
    costs: dict[str, tuple[tuple[float, ...], ...]]

    def columns(self) -> list[str]:
        return sorted(self.costs)

    def verify_column(self, num_draft_tokens: int) -> str:
        """The measured verify width closest to (and at least) the draft token count."""
        widths = sorted(int(c[len("target_q"):-3]) for c in self.costs if c.startswith("target_q"))
        for w in widths:
            if w >= num_draft_tokens:
                return f"target_q{w}_ms"
        raise ProfileError(f"step table has no target_qN_ms column with N >= {num_draft_tokens}")

    def cost(self, column: str, batch: float, ctx: float) -> float:
        if column not in self.costs:
            raise ProfileError(f"step table has no {column!r} column")
        grid = self.costs[column]
        ci, cw = _bracket(self.ctxs, ctx, clamp=True)
        lo = _interp_batch(self.batches, grid[ci], batch)
        if cw == 0.0:
            return lo
        hi = _interp_batch(self.batches, grid[ci + 1], batch)
        return lo + (hi - lo) * cw


def _bracket(xs: tuple[int, ...], x: float, clamp: bool) -> tuple[int, float]:
    """Index i and weight w so that x ~ xs[i] + w * (xs[i+1] - xs[i])."""
    if len(xs) == 1:
        return 0, 0.0
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    if clamp:
        w = min(max(w, 0.0), 1.0)
    return i, w


def _interp_batch(batches: tuple[int, ...], row: tuple[float, ...], batch: float) -> float:
    if len(batches) == 1:
        return row[0] * max(batch, 1.0) / batches[0]
    i, w = _bracket(batches, batch, clamp=False)
    if batch < batches[0]:
        w = 0.0  # below the smallest measured batch: the fixed cost dominates, keep it
    return row[i] + (row[i + 1] - row[i]) * w


def load_step_table(path: Path) -> StepTable:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read step table {path}: {exc}") from None
    try:
        rows = parse_step_table(text, f"step table {path}")
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    batches = tuple(sorted({r["batch"] for r in rows}))
    ctxs = tuple(sorted({r["ctx"] for r in rows}))
    columns = {k for r in rows for k, v in r.items()
               if k.endswith("_ms") and not k.startswith("floor") and isinstance(v, int | float)}
    costs: dict[str, tuple[tuple[float, ...], ...]] = {}
    by_key = {(r["ctx"], r["batch"]): r for r in rows}
    for col in columns:
        grid = []
        for ctx in ctxs:
            grid.append(tuple(_fill(by_key, ctx, batches, col, path)))
        costs[col] = tuple(grid)
    return StepTable(batches, ctxs, costs)


def _fill(by_key: dict[tuple[int, int], dict[str, Any]], ctx: int, batches: tuple[int, ...],
          col: str, path: Path) -> list[float]:
    """One ctx row over every batch; batches not measured at this ctx are interpolated
    between the neighbouring measured ones (the ctx8192 file skips some batch sizes)."""
    known = [(b, float(by_key[(ctx, b)][col])) for b in batches
             if (ctx, b) in by_key and isinstance(by_key[(ctx, b)].get(col), int | float)]
    if not known:
        raise ProfileError(f"{path}: column {col} has no value at ctx {ctx}")
    kb = tuple(b for b, _ in known)
    kv = tuple(v for _, v in known)
    return [_interp_batch(kb, kv, b) for b in batches]


@dataclass(frozen=True)
class DraftConfig:
    steps: int
    topk: int
    num_draft_tokens: int


@dataclass(frozen=True)
class OutputLength:
    """Per-request output length when the client does not set ignore_eos: lognormal with
    this median and sigma, at least 1, capped by max_tokens."""

    median: float = 256.0
    sigma: float = 0.0


@dataclass(frozen=True)
class EngineDefaults:
    max_running_requests: int
    kv_capacity_tokens: int


@dataclass(frozen=True)
class Profile:
    name: str
    model_path: str
    served_model_name: str
    context_length: int
    step_table: StepTable
    step_table_file: str
    time_factor: float  # multiplies every table cost: a slower deployment than the measured one
    draft: DraftConfig
    accept_length: float
    accept_length_schedule: tuple[tuple[float, float], ...]
    eagle: EngineDefaults
    baseline: EngineDefaults
    prefill_base_ms: float
    prefill_per_token_ms: float
    chunked_prefill_size: int
    draft_prefill_factor: float  # EAGLE prefill also runs the draft model over the prompt
    output_length: OutputLength
    chars_per_token: float
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


def profile_path(name_or_path: str) -> Path:
    """A shipped profile by name, or any file path."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json" or os.sep in name_or_path:
        if not candidate.is_file():
            raise ProfileError(f"profile file {name_or_path} not found")
        return candidate
    shipped = PROFILE_DIR / f"{name_or_path}.json"
    if not shipped.is_file():
        names = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
        raise ProfileError(f"unknown profile {name_or_path!r}; shipped profiles: {names}")
    return shipped


def load_profile(name_or_path: str) -> Profile:
    path = profile_path(name_or_path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {path}: expected a JSON object")
    return parse_profile(raw, path.parent, path.stem)


def _num(raw: dict[str, Any], key: str, default: float | None = None, *,
         minimum: float = 0.0) -> float:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ProfileError(f"profile field {key!r} must be a number")
    if v < minimum:
        raise ProfileError(f"profile field {key!r} must be >= {minimum}")
    return float(v)


def _engine(raw: Any, key: str, default_running: int, default_kv: int) -> EngineDefaults:
    section = raw if isinstance(raw, dict) else {}
    return EngineDefaults(
        int(_num(section, "max_running_requests", default_running, minimum=1)),
        int(_num(section, "kv_capacity_tokens", default_kv, minimum=1)),
    )


def parse_schedule(value: Any) -> tuple[tuple[float, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ProfileError("accept_length_schedule must be a list of [t_seconds, value]")
    out: list[tuple[float, float]] = []
    for item in value:
        if (not isinstance(item, list | tuple) or len(item) != 2
                or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in item)):
            raise ProfileError("accept_length_schedule items must be [t_seconds, value]")
        if item[1] < 1.0:
            raise ProfileError("accept length values must be >= 1")
        out.append((float(item[0]), float(item[1])))
    return tuple(sorted(out))


def parse_profile(raw: dict[str, Any], base_dir: Path, name: str) -> Profile:
    table_file = raw.get("step_table")
    if not isinstance(table_file, str):
        raise ProfileError("profile field 'step_table' (a .jsonl file name) is required")
    table_path = Path(table_file) if os.path.isabs(table_file) else base_dir / table_file
    table = load_step_table(table_path)
    draft_raw = raw.get("draft", {})
    if not isinstance(draft_raw, dict):
        raise ProfileError("profile field 'draft' must be an object")
    draft = DraftConfig(int(_num(draft_raw, "steps", 3, minimum=1)),
                        int(_num(draft_raw, "topk", 1, minimum=1)),
                        int(_num(draft_raw, "num_draft_tokens", 4, minimum=2)))
    table.verify_column(draft.num_draft_tokens)  # fail at load time, not on the first step
    accept = _num(raw, "accept_length", 2.0, minimum=1.0)
    if accept > draft.num_draft_tokens:
        raise ProfileError("accept_length cannot exceed draft.num_draft_tokens")
    out_raw = raw.get("output_length", {})
    out_raw = out_raw if isinstance(out_raw, dict) else {}
    prefill = raw.get("prefill", {})
    prefill = prefill if isinstance(prefill, dict) else {}
    model_path = str(raw.get("model_path", "meta-llama/Llama-3.1-8B-Instruct"))
    return Profile(
        name=str(raw.get("name", name)),
        model_path=model_path,
        served_model_name=str(raw.get("served_model_name", model_path)),
        context_length=int(_num(raw, "context_length", 131072, minimum=16)),
        step_table=table,
        step_table_file=str(table_file),
        time_factor=_num(raw, "time_factor", 1.0),
        draft=draft,
        accept_length=accept,
        accept_length_schedule=parse_schedule(raw.get("accept_length_schedule")),
        eagle=_engine(raw.get("eagle"), "eagle", 48, 400_000),
        baseline=_engine(raw.get("baseline"), "baseline", 256, 600_000),
        prefill_base_ms=_num(prefill, "base_ms", 5.0),
        prefill_per_token_ms=_num(prefill, "per_token_ms", 0.02),
        chunked_prefill_size=int(_num(prefill, "chunked_prefill_size", 8192, minimum=1)),
        draft_prefill_factor=_num(prefill, "draft_factor", 0.1),
        output_length=OutputLength(_num(out_raw, "median", 256.0, minimum=1.0),
                                   _num(out_raw, "sigma", 0.0)),
        chars_per_token=_num(raw, "chars_per_token", 4.0, minimum=0.5),
        raw=raw,
    )


def engine_limits(profile: Profile, kind: str) -> EngineDefaults:
    """An engine's batch slots and KV pool. The adaptive engine has the GPU to itself: one
    cache over the memory both servers of a pair would split (the sum of their pools), and
    the baseline's batch slots, since SGLang caps a speculative server at 48 unless
    --max-running-requests is given (speculative_hook.py 0.5.23:1086-1094) and adaptive
    speculation only stops drafting from batch 64."""
    if kind == "adaptive":
        return EngineDefaults(profile.baseline.max_running_requests,
                              profile.eagle.kv_capacity_tokens
                              + profile.baseline.kv_capacity_tokens)
    return profile.eagle if kind == "eagle" else profile.baseline
