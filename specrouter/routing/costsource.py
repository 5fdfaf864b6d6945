"""Where a GPU group's cost model comes from: the `cost_model` / `cost_models` settings.

The I/O side of `specrouter.routing.costmodel` (which stays pure): each source names one file and
is read and checked when the settings are validated, so a missing file or a bad table
stops `specrouter serve` at start-up with the field's path in the message, not on the
first request. Three kinds of source, exactly one per entry:

- `step_table`: a step-cost jsonl (the format of shared/calibration: batch, ctx,
  target_qN_ms, draft_step_ms) plus the server's draft config;
- `profile`: a simulator-style profile JSON (a path, or the name of a shipped profile)
  and the step table it names; read as plain JSON, the simulator is never imported;
- `file`: a cost-model JSON written by `specrouter calibrate --write-cost-model`.

A table measured at several contexts gives a model over all of them: the router reads
it at the mean prompt tokens of the group's recent traffic (`ContextCostModel`,
`routing/learning.py`). `ctx` pins one measured context instead (the nearest to it).

Relative paths are taken from the working directory; a profile's step table from the
profile's own directory (as the simulator does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from specrouter.routing.costmodel import (
    DraftConfig,
    GroupCostModel,
    model_from_dict,
    model_from_profile,
    model_from_step_table,
)
from specrouter.steptable import parse_step_table

#: Profiles shipped with the simulator, found by name without importing it.
SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "sim" / "profiles"

#: The simulator's defaults when a profile leaves a server's max running requests out.
_PROFILE_MAX_RUNNING = {"eagle": 48, "baseline": 256}


class DraftSettings(BaseModel):
    """SGLang's --speculative-num-steps / --speculative-eagle-topk /
    --speculative-num-draft-tokens of the EAGLE-3 server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=3, ge=1)
    topk: int = Field(default=1, ge=1)
    num_draft_tokens: int = Field(default=4, ge=1)


class CostModelSource(BaseModel):
    """One group's cost model (or every group's, as `cost_model`). See the module docstring.

    `accept_length` is the nominal accept length, used until the EAGLE server reports
    one (default: the profile's or file's, else 2.0). `eagle_max_batch` /
    `baseline_max_batch` are the servers' --max-running-requests (default: the
    profile's or file's; for a step table 48 for EAGLE, no cap for the baseline).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_table: str | None = None
    profile: str | None = None
    file: str | None = None
    draft: DraftSettings = Field(default_factory=DraftSettings)
    ctx: int | None = Field(default=None, ge=1)
    accept_length: float | None = Field(default=None, ge=1)
    eagle_max_batch: int | None = Field(default=None, ge=1)
    baseline_max_batch: int | None = Field(default=None, ge=1)

    _model: GroupCostModel | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _load(self) -> CostModelSource:
        given = [k for k in ("step_table", "profile", "file") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of step_table, profile or file "
                             f"(got {', '.join(given) or 'none'})")
        self._model = self._build()
        return self

    def model(self) -> GroupCostModel:
        """The model read at validation time."""
        if self._model is None:  # a model_construct()ed instance skipped validation
            self._model = self._build()
        return self._model

    def _build(self) -> GroupCostModel:
        if self.step_table:
            rows = parse_step_table(_read(self.step_table, "step table"))
            return _overridden(model_from_step_table(
                rows, DraftConfig(self.draft.steps, self.draft.topk, self.draft.num_draft_tokens),
                ctx=self.ctx, eagle_max_batch=48), self)
        if self.profile:
            return _overridden(profile_model(self.profile, self.ctx), self)
        assert self.file is not None
        try:
            data = json.loads(_read(self.file, "cost-model file"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost-model file {self.file}: not JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"cost-model file {self.file}: expected a JSON object")
        try:
            return _overridden(model_from_dict(data), self)
        except ValueError as exc:
            raise ValueError(f"cost-model file {self.file}: {exc}") from None


def _overridden(model: GroupCostModel, source: CostModelSource) -> GroupCostModel:
    from dataclasses import replace

    changes: dict[str, Any] = {}
    if source.accept_length is not None:
        changes["nominal_accept_length"] = source.accept_length
    if source.eagle_max_batch is not None:
        changes["eagle_max_batch"] = source.eagle_max_batch
    if source.baseline_max_batch is not None:
        changes["baseline_max_batch"] = source.baseline_max_batch
    return replace(model, **changes) if changes else model


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


def profile_file(name_or_path: str) -> Path:
    """A profile path, or the file of a shipped profile named without `.json`."""
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        return Path(name_or_path)
    return SHIPPED_PROFILES / f"{name_or_path}.json"


def profile_model(name_or_path: str, ctx: int | None = None) -> GroupCostModel:
    """The cost model of a simulator profile: what the simulator's physics would do.

    The profile's `time_factor` scales every step (the simulator multiplies its table
    by it); its `--time-scale` does not matter here, since it scales both pools alike
    and the choice depends on their ratio only.
    """
    path = profile_file(name_or_path)
    try:
        profile = json.loads(_read(str(path), "profile"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path}: not JSON ({exc.msg})") from None
    if not isinstance(profile, dict) or not isinstance(profile.get("step_table"), str):
        raise ValueError(f"profile {path}: needs a 'step_table' (a .jsonl file name)")
    table = Path(profile["step_table"])
    table = table if table.is_absolute() else path.parent / table
    rows = parse_step_table(_read(str(table), "step table"))
    factor = profile.get("time_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
        raise ValueError(f"profile {path}: 'time_factor' must be a positive number")
    rows = [{k: (v * factor if k.endswith("_ms") and isinstance(v, int | float) else v)
             for k, v in r.items()} for r in rows]
    profile = {**profile, "draft": profile.get("draft", {})}
    for pool, default in _PROFILE_MAX_RUNNING.items():
        section = profile.get(pool)
        section = dict(section) if isinstance(section, dict) else {}
        section.setdefault("max_running_requests", default)
        profile[pool] = section
    try:
        return model_from_profile(profile, rows, ctx=ctx)
    except ValueError as exc:
        raise ValueError(f"profile {path}: {exc}") from None
