"""Goodput model of one GPU group: what each pool would deliver at a given load.

Pure arithmetic, no I/O: the caller reads files and passes their text or rows.

One decode step of a batch of B requests costs step(B) ms. The baseline server emits
one token per request per step; the EAGLE-3 server emits `accept_length` tokens per
request per step, at the cost of one verify forward over the draft tokens plus the
draft steps. So at batch B:

    throughput_P(B) = B * tokens_per_step_P / step_P(B)        (tokens per ms)
    per-request time per output token = step_P(B) / tokens_per_step_P

At a fixed load both criteria rank the pools the same way (throughput = B / TPOT),
which is why one ratio, acc * step_base(B) / step_eagle(B), decides (docs/policy.md).
Beyond a server's `max_batch` (SGLang's --max-running-requests) extra requests wait:
the batch stays at max_batch and per-request time grows with the queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specrouter.backends import Pool


class StepCurve(Protocol):
    """Milliseconds of one decode (or draft + verify) step at a batch size."""

    def ms(self, batch: float) -> float: ...


@dataclass(frozen=True)
class TableCurve:
    """Measured (batch, ms) points, linear between them and beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step-cost table needs at least one point")
        if any(b <= 0 or ms <= 0 for b, ms in self.points):
            raise ValueError("batch sizes and step times must be positive")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    def ms(self, batch: float) -> float:
        pts = self.points
        if len(pts) == 1 or batch <= pts[0][0]:
            return pts[0][1]  # a step is never cheaper than the smallest measured batch's
        if batch >= pts[-1][0]:
            lo, hi = pts[-2], pts[-1]
        else:
            hi_i = next(i for i, (b, _) in enumerate(pts) if b >= batch)
            lo, hi = pts[hi_i - 1], pts[hi_i]
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
        return lo[1] + slope * (batch - lo[0])


@dataclass(frozen=True)
class PolyCurve:
    """step(B) = a + b*B + c*B^2, as fitted from calibration sweeps."""

    a: float
    b: float
    c: float = 0.0

    def ms(self, batch: float) -> float:
        return max(1e-6, self.a + self.b * batch + self.c * batch * batch)


@dataclass(frozen=True)
class PoolPrediction:
    pool: Pool
    load: float
    batch: float
    step_ms: float
    throughput_tok_s: float
    tpot_ms: float  # per-request time per output token, queueing included

    def as_dict(self) -> dict[str, float | str]:
        return {
            "pool": self.pool, "load": self.load, "batch": round(self.batch, 3),
            "step_ms": round(self.step_ms, 4),
            "throughput_tok_s": round(self.throughput_tok_s, 2),
            "tpot_ms": round(self.tpot_ms, 4),
        }


@dataclass(frozen=True)
class GroupCostModel:
    """Cost model of one GPU group (one EAGLE-3 server and one baseline server).

    `nominal_accept_length` is the accept length the EAGLE curve was measured at (or a
    sensible default); it is used only while no live accept length is known.
    """

    baseline: StepCurve
    eagle: StepCurve
    nominal_accept_length: float = 2.0
    baseline_max_batch: int | None = None
    eagle_max_batch: int | None = None

    def curve(self, pool: Pool) -> StepCurve:
        """`pool`'s step-cost curve."""
        return self.eagle if pool == "eagle" else self.baseline

    def at_context(self, context: float | None) -> GroupCostModel:
        """The model for decoding at `context` prompt tokens: this one, which has no
        context axis (`ContextCostModel` has)."""
        return self

    def predict(self, pool: Pool, load: float, accept_length: float) -> PoolPrediction:
        if accept_length <= 0:
            raise ValueError("accept_length must be positive")
        load = max(1.0, float(load))
        batch, per_step = self._batch(pool, load, accept_length)
        step = self.curve(pool).ms(batch)
        throughput = 1000.0 * batch * per_step / step
        return PoolPrediction(pool, load, batch, step, throughput, 1000.0 * load / throughput)

    def throughput_tok_s(self, pool: Pool, load: float, accept_length: float) -> float:
        """`predict(pool, load, accept_length).throughput_tok_s` without the rest: what a
        search over loads evaluates many times per decision."""
        batch, per_step = self._batch(pool, max(1.0, load), accept_length)
        return 1000.0 * batch * per_step / self.curve(pool).ms(batch)

    def _batch(self, pool: Pool, load: float, accept_length: float) -> tuple[float, float]:
        """The batch `pool` runs at `load` (the requests past its cap queue) and the output
        tokens each of its requests makes per step."""
        cap, per_step = ((self.eagle_max_batch, accept_length) if pool == "eagle"
                         else (self.baseline_max_batch, 1.0))
        return (min(load, float(cap)) if cap else load), per_step

    def predictions(self, load: float, accept_length: float) -> dict[Pool, PoolPrediction]:
        """Both pools at `load`; what /policy shows."""
        return {p: self.predict(p, load, accept_length) for p in ("eagle", "baseline")}

    def ratio(self, load: float, accept_length: float) -> float:
        """EAGLE / baseline throughput at `load` (>1: EAGLE serves the group better)."""
        pred = self.predictions(load, accept_length)
        return pred["eagle"].throughput_tok_s / pred["baseline"].throughput_tok_s

    def crossover(self, accept_length: float, max_load: int = 1024) -> float | None:
        """The load where the baseline overtakes EAGLE-3, or None within `max_load`.

        0.0 means the baseline is ahead already at load 1 (EAGLE never pays).
        Interpolated linearly in the ratio between the bracketing integer loads.
        """
        prev_load, prev = 1, self.ratio(1, accept_length)
        if prev <= 1.0:
            return 0.0
        for load in range(2, max_load + 1):
            cur = self.ratio(load, accept_length)
            if cur <= 1.0:
                return prev_load + (prev - 1.0) / (prev - cur) * (load - prev_load)
            prev_load, prev = load, cur
        return None


@dataclass(frozen=True)
class BlendCurve:
    """`low`'s step times moved `weight` of the way to `high`'s."""

    low: StepCurve
    high: StepCurve
    weight: float

    def ms(self, batch: float) -> float:
        lo = self.low.ms(batch)
        return lo + (self.high.ms(batch) - lo) * self.weight


@dataclass(frozen=True)
class ContextCostModel(GroupCostModel):
    """A group cost model measured at several contexts: attention reads the whole context
    at every step, so a step's cost, and with it the crossover, moves with the prompt
    tokens the group decodes at (the seed-coding table: about 1.7 requests at 1,024 tokens,
    14 at 8,192 and beyond).

    `by_context` holds (context, baseline curve, EAGLE-3 curve) at each measured context,
    ascending; `at_context` interpolates linearly between the two around a context and
    keeps the nearest end's curves outside them, as the simulator's step table does
    (`sim/profile.py`). The model's own curves are those of the smallest context: what
    a decision reads before any traffic says where the group decodes."""

    by_context: tuple[tuple[float, StepCurve, StepCurve], ...] = ()

    def at_context(self, context: float | None) -> GroupCostModel:
        points = self.by_context
        if context is None or not points:
            return GroupCostModel(self.baseline, self.eagle, self.nominal_accept_length,
                                  self.baseline_max_batch, self.eagle_max_batch)
        above = next((i for i, p in enumerate(points) if p[0] >= context), len(points))
        if above == 0 or above == len(points):
            _, base, eagle = points[min(above, len(points) - 1)]
        else:
            (c0, b0, e0), (c1, b1, e1) = points[above - 1], points[above]
            w = (context - c0) / (c1 - c0)
            base, eagle = BlendCurve(b0, b1, w), BlendCurve(e0, e1, w)
        return GroupCostModel(base, eagle, self.nominal_accept_length,
                              self.baseline_max_batch, self.eagle_max_batch)


# --- loading: step-cost tables (shared/calibration jsonl) -------------------------------


@dataclass(frozen=True)
class DraftConfig:
    """EAGLE draft shape: SGLang's --speculative-num-steps / -eagle-topk / -num-draft-tokens."""

    steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if self.steps < 1 or self.topk < 1 or self.num_draft_tokens < 1:
            raise ValueError("draft steps, topk and num_draft_tokens must be >= 1")


def model_from_step_table(
    rows: Iterable[Mapping[str, Any]],
    draft: DraftConfig,
    *,
    ctx: int | None = None,
    nominal_accept_length: float = 2.0,
    baseline_max_batch: int | None = None,
    eagle_max_batch: int | None = 48,
) -> GroupCostModel:
    """Build a model from measured step costs.

    EAGLE step = verify(B, W) + steps * draft_step(B), as in shared/calibration/crossover.py,
    where W is the smallest measured verify width >= num_draft_tokens (the simulator's
    rule, so predictions match its physics). A table measured at several context lengths
    gives a `ContextCostModel` over all of them, unless `ctx` picks one (a ctx that was
    not measured takes the nearest measured one). The measured draft step used topk 4;
    topk is kept for the record, the table has no topk axis.
    """
    rows = list(rows)
    ctxs = sorted({int(r.get("ctx", 0)) for r in rows})
    if ctx is not None:
        nearest = min(ctxs, key=lambda c: (abs(c - ctx), c))
        ctxs = [nearest]
    curves = [(float(c), *_table_curves([r for r in rows if int(r.get("ctx", 0)) == c], draft))
              for c in ctxs]
    _, base, eagle = curves[0]
    if len(curves) == 1:
        return GroupCostModel(base, eagle, nominal_accept_length, baseline_max_batch,
                              eagle_max_batch)
    return ContextCostModel(base, eagle, nominal_accept_length, baseline_max_batch,
                            eagle_max_batch, tuple(curves))


def _table_curves(rows: Sequence[Mapping[str, Any]], draft: DraftConfig
                  ) -> tuple[TableCurve, TableCurve]:
    """The baseline's and EAGLE-3's step curves of one context's rows."""
    verify_key = _verify_column(rows, draft.num_draft_tokens)
    missing = [r["batch"] for r in rows if verify_key not in r or "draft_step_ms" not in r]
    if missing:
        raise ValueError(f"rows for batch {missing} lack {verify_key} or draft_step_ms")
    base = TableCurve(tuple((float(r["batch"]), float(r["target_q1_ms"])) for r in rows))
    eagle = TableCurve(tuple(
        (float(r["batch"]), float(r[verify_key]) + draft.steps * float(r["draft_step_ms"]))
        for r in rows
    ))
    return base, eagle


def _verify_column(rows: Sequence[Mapping[str, Any]], num_draft_tokens: int) -> str:
    widths = sorted({int(k[len("target_q"):-3]) for r in rows for k in r
                     if k.startswith("target_q") and k.endswith("_ms") and k != "target_q1_ms"})
    for w in widths:
        if w >= num_draft_tokens:
            return f"target_q{w}_ms"
    have = [f"target_q{w}_ms" for w in widths]
    raise ValueError(f"no verify column target_qN_ms with N >= {num_draft_tokens} (have {have})")


def model_from_profile(
    profile: Mapping[str, Any], step_rows: Iterable[Mapping[str, Any]], ctx: int | None = None
) -> GroupCostModel:
    """Model of a simulator profile (specrouter/sim/profiles/*.json, already parsed), with
    its step table rows; draft config, accept length and max running requests come from
    the profile. Pure: the caller reads both files."""
    try:
        draft = DraftConfig(**profile["draft"])
        accept = float(profile.get("accept_length", 2.0))
        eagle_max = profile.get("eagle", {}).get("max_running_requests")
        base_max = profile.get("baseline", {}).get("max_running_requests")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"profile lacks a usable 'draft' / pool section: {exc}") from None
    return model_from_step_table(step_rows, draft, ctx=ctx, nominal_accept_length=accept,
                                 baseline_max_batch=base_max, eagle_max_batch=eagle_max)


# --- fitting: calibration sweeps ---------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    """One closed-loop level of a calibration sweep against one pool.

    `output_tok_s` is the pool's total output throughput at `concurrency` requests.
    """

    concurrency: int
    output_tok_s: float


def step_ms_from_sweep(point: SweepPoint, tokens_per_step_per_req: float) -> float:
    """Invert throughput into step time: with B decoding, step = B * tokens/step / T."""
    if point.concurrency < 1 or point.output_tok_s <= 0:
        raise ValueError("sweep points need concurrency >= 1 and positive throughput")
    return 1000.0 * point.concurrency * tokens_per_step_per_req / point.output_tok_s


def fit_curve(points: Sequence[tuple[float, float]], quadratic: bool = False) -> PolyCurve:
    """Least squares of step(B) = a + b*B (+ c*B^2) over (batch, ms) points."""
    degree = 2 if quadratic else 1
    if len({b for b, _ in points}) < degree + 1:
        raise ValueError(f"need at least {degree + 1} distinct batch sizes to fit degree {degree}")
    n = degree + 1
    # Normal equations: (X^T X) w = X^T y, solved by Gaussian elimination (n <= 3).
    xtx = [[sum(b ** (i + j) for b, _ in points) for j in range(n)] for i in range(n)]
    xty = [sum(ms * b**i for b, ms in points) for i in range(n)]
    w = _solve(xtx, xty)
    return PolyCurve(w[0], w[1], w[2] if quadratic else 0.0)


def _solve(a: list[list[float]], y: list[float]) -> list[float]:
    n = len(y)
    m = [[*row, y[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            raise ValueError("sweep points are degenerate: cannot fit")
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * p for x, p in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_group_model(
    baseline: Sequence[SweepPoint],
    eagle: Sequence[SweepPoint],
    eagle_accept_length: float,
    *,
    quadratic: bool = False,
    baseline_max_batch: int | None = None,
    eagle_max_batch: int | None = None,
) -> GroupCostModel:
    """Model from `specrouter calibrate` sweeps of each pool alone.

    Assumes closed-loop concurrency C keeps about C requests in the decode batch (true
    once prefill is a small share of each request), and that the EAGLE sweep ran at
    `eagle_accept_length` (the accept length the server reported during the sweep).
    """
    if eagle_accept_length <= 0:
        raise ValueError("eagle_accept_length must be positive")
    base_pts = [(float(p.concurrency), step_ms_from_sweep(p, 1.0)) for p in baseline]
    eagle_pts = [(float(p.concurrency), step_ms_from_sweep(p, eagle_accept_length)) for p in eagle]
    return GroupCostModel(
        fit_curve(base_pts, quadratic), fit_curve(eagle_pts, quadratic),
        eagle_accept_length, baseline_max_batch, eagle_max_batch,
    )


# --- serialisation: the cost-model JSON of `specrouter calibrate --write-cost-model` ------

COST_MODEL_FORMAT = "specrouter-cost-model"


def model_to_dict(model: GroupCostModel) -> dict[str, Any]:
    """JSON-ready form of a model; `model_from_dict` reads it back exactly."""
    return {
        "format": COST_MODEL_FORMAT, "version": 1,
        "nominal_accept_length": model.nominal_accept_length,
        "baseline_max_batch": model.baseline_max_batch,
        "eagle_max_batch": model.eagle_max_batch,
        "baseline": _curve_to_dict(model.baseline), "eagle": _curve_to_dict(model.eagle),
    }


def _curve_to_dict(curve: StepCurve) -> dict[str, Any]:
    if isinstance(curve, PolyCurve):
        return {"poly": [curve.a, curve.b, curve.c]}
    if isinstance(curve, TableCurve):
        return {"points": [list(p) for p in curve.points]}
    raise ValueError(f"cannot serialise a {type(curve).__name__} step curve")


def model_from_dict(data: Mapping[str, Any]) -> GroupCostModel:
    """A model from `model_to_dict`'s form; every malformed field is named in the error."""
    if data.get("format") != COST_MODEL_FORMAT:
        raise ValueError(f"not a cost-model file: 'format' must be {COST_MODEL_FORMAT!r}")
    accept = data.get("nominal_accept_length")
    if isinstance(accept, bool) or not isinstance(accept, int | float) or accept <= 0:
        raise ValueError("'nominal_accept_length' must be a positive number")
    caps = {k: data.get(k) for k in ("baseline_max_batch", "eagle_max_batch")}
    for key, cap in caps.items():
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"'{key}' must be a positive integer or null")
    return GroupCostModel(_curve_from_dict(data.get("baseline"), "baseline"),
                          _curve_from_dict(data.get("eagle"), "eagle"), float(accept),
                          caps["baseline_max_batch"], caps["eagle_max_batch"])


def _curve_from_dict(raw: Any, key: str) -> StepCurve:
    try:
        if isinstance(raw, Mapping) and "poly" in raw:
            a, b, c = (float(x) for x in raw["poly"])
            return PolyCurve(a, b, c)
        if isinstance(raw, Mapping) and "points" in raw:
            return TableCurve(tuple((float(b), float(ms)) for b, ms in raw["points"]))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"'{key}' curve is malformed: {exc}") from None
    raise ValueError(f"'{key}' must be {{'poly': [a, b, c]}} or {{'points': [[batch, ms], ...]}}")
