"""The sweep, the recommended policy and the fitted cost model as text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from specrouter.commands.calibrate.derive import Recommendation
from specrouter.commands.calibrate.measure import LevelResult, ratio
from specrouter.routing.costmodel import GroupCostModel


def level_row(r: LevelResult) -> str:
    """One line per measured level, printed as the sweep goes."""
    return (f"{r.pool:9s} c={r.concurrency:<4d} reqs={r.requests:<5d} err={r.errors:<3d} "
            f"out={r.throughput_tok_s:9.1f} tok/s  p50={_ms(r.median_latency_s)}  "
            f"p90={_ms(r.p90_latency_s)}  ttft50={_ms(r.median_ttft_s)}")


def report(results: Mapping[str, Sequence[LevelResult]], rec: Recommendation,
           accept: float | None) -> str:
    lines = ["", "level  eagle tok/s  baseline tok/s  ratio  eagle p50  baseline p50  better"]
    for e, b in zip(results["eagle"], results["baseline"], strict=True):
        lines.append(f"{e.concurrency:5d}  {e.throughput_tok_s:11.1f}  {b.throughput_tok_s:14.1f}"
                     f"  {ratio(e, b):5.2f}  {_ms(e.median_latency_s):>9s}  "
                     f"{_ms(b.median_latency_s):>12s}  {rec.better[e.concurrency]}")
    cross = ("baseline ahead at every level" if rec.crossover == 0.0 else
             "EAGLE-3 ahead at every level" if rec.crossover is None else
             f"{rec.crossover:.2f} concurrent requests")
    lines.append(f"crossover: {cross}")
    if accept is not None:
        lines.append(f"EAGLE-3 accept length during the sweep: {accept:.2f}")
    lines.append(f"policy ({rec.strategy}): {json.dumps(rec.patch)}")
    return "\n".join(lines)


def model_report(model: GroupCostModel) -> str:
    """The fitted model's crossover at the sweep's accept length and around it."""
    def fmt(x: float | None) -> str:
        return "never (EAGLE-3 ahead)" if x is None else f"{x:.1f}"

    nominal = model.nominal_accept_length
    lines = [f"cost model (accept length {nominal:.2f}): crossover at "
             f"{fmt(model.crossover(nominal))} concurrent requests"]
    others = ", ".join(f"{a:g}: {fmt(model.crossover(a))}" for a in (1.6, 2.0, 2.5, 3.0, 4.0))
    lines.append(f"  crossover at other accept lengths: {others}")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000.0:.1f}ms"
