"""The group's cost model fitted from a sweep (for the goodput strategy)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from specrouter.commands.calibrate.measure import LevelResult, SweepFacts
from specrouter.routing.costmodel import (
    GroupCostModel,
    SweepPoint,
    TableCurve,
    fit_group_model,
    step_ms_from_sweep,
)

FITS = ("table", "linear", "quadratic")


def fit_model(results: Mapping[str, Sequence[LevelResult]], facts: SweepFacts,
              fit: str = "table") -> GroupCostModel:
    """The group's cost model from the sweep.

    Each level is inverted into a step time at its batch (`step = 1000 * C * tokens per
    step / throughput`); a level above a server's max running requests decoded only that
    many at once, so it is inverted at that batch. `table` joins the points piecewise
    linearly, so the model reproduces the measured ratio (and crossover) at every level;
    `linear` / `quadratic` least-squares fit a smoother curve whose small-batch error can
    move the crossover. Raises ValueError when the sweep cannot give a model (no accept
    length, too few levels).
    """
    accept = facts.accept_length
    if accept is None:
        raise ValueError("the EAGLE server reported no accept length during the sweep "
                         "(/v1/loads speculative.accept_length or /server_info "
                         "internal_states[].avg_spec_accept_length)")
    caps = {p: facts.max_running.get(p) for p in ("eagle", "baseline")}

    def points(pool: str) -> list[SweepPoint]:
        cap = caps[pool]
        return [SweepPoint(min(r.concurrency, cap) if cap else r.concurrency,
                           r.throughput_tok_s) for r in results[pool]]

    if fit != "table":
        return fit_group_model(points("baseline"), points("eagle"), accept,
                               quadratic=fit == "quadratic",
                               baseline_max_batch=caps["baseline"], eagle_max_batch=caps["eagle"])
    return GroupCostModel(_table(points("baseline"), 1.0), _table(points("eagle"), accept),
                          accept, caps["baseline"], caps["eagle"])


def _table(points: Sequence[SweepPoint], tokens_per_step: float) -> TableCurve:
    """Step times at each measured batch (levels sharing a batch, beyond a server's cap,
    averaged)."""
    by_batch: dict[int, list[float]] = {}
    for p in points:
        by_batch.setdefault(p.concurrency, []).append(step_ms_from_sweep(p, tokens_per_step))
    return TableCurve(tuple((float(b), statistics.fmean(v)) for b, v in by_batch.items()))
