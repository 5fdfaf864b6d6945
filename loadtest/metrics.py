"""Per-request measurements and their summaries (percentiles, throughput, goodput).

Times are recorded in wall-clock seconds. Runs against the simulator use `--time-scale`
to shrink every simulated duration; `summarize(..., time_scale=s)` converts back to
simulated seconds (durations / s, rates * s), so reports read like real-GPU numbers.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds from `start`."""

    start: float  # seconds since the run began
    ok: bool = False
    status: int = 0
    ttfb: float | None = None  # to the response headers (what a proxy adds, unquantized)
    ttft: float | None = None  # to the first content chunk
    e2e: float | None = None
    output_tokens: int = 0  # from the usage chunk, else the number of content chunks
    prompt_tokens: int = 0
    chunks: int = 0  # content chunks (one chunk may hold several tokens)
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str = ""
    pool: str = ""  # x-specrouter-pool, when a router answered
    backend: str = ""  # x-specrouter-backend
    reason: str = ""  # x-specrouter-reason
    phase: str = ""
    request_id: str = ""  # the x-request-id it was sent with
    sent_at: float | None = None  # time.perf_counter() as it was sent (the host's clock)
    # real seconds the request stayed in simulated engines before its first token, when
    # read from them (`loadtest.residence`)
    engine_s: float | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float | None:
        return None if self.e2e is None else self.start + self.e2e

    def deployed_ttft(self, time_scale: float) -> float | None:
        """The time to the first token in simulated seconds with only the engines' part
        converted: the rest (proxies, HTTP hops) is real time, which no GPU speeds up."""
        if self.ttft is None or self.engine_s is None:
            return None
        return self.ttft - self.engine_s + self.engine_s / time_scale


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 1]."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(values: Sequence[float], scale: float) -> dict[str, float]:
    out = {f"p{round(q * 100)}": percentile(values, q) / scale for q in QUANTILES}
    out["mean"] = (sum(values) / len(values) / scale) if values else math.nan
    return out


@dataclass(frozen=True)
class SLO:
    """A request meets the SLO when its TTFT and its TPOT are both within bounds."""

    ttft_s: float = 2.0
    tpot_s: float = 0.05

    def met(self, r: RequestResult, time_scale: float = 1.0) -> bool:
        if not r.ok or r.ttft is None:
            return False
        tpot = r.tpot if r.tpot is not None else 0.0
        return r.ttft / time_scale <= self.ttft_s and tpot / time_scale <= self.tpot_s


def summarize(
    results: Sequence[RequestResult],
    duration: float | None = None,
    time_scale: float = 1.0,
    slo: SLO | None = None,
) -> dict[str, Any]:
    """Summary of a run in simulated units (seconds, tokens/s, requests/s).

    `duration` is the wall time over which throughput is counted; by default the span
    from the first start to the last end.
    """
    done = [r for r in results if r.ok]
    if duration is None:
        ends = [r.end for r in done if r.end is not None]
        duration = (max(ends) - min(r.start for r in results)) if ends else 0.0
    sim_duration = duration / time_scale if duration > 0 else math.nan
    tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(done),
        "errors": len(results) - len(done),
        "duration_s": sim_duration,
        "output_tokens": tokens,
        "output_tok_s": tokens / sim_duration if duration > 0 else math.nan,
        "req_s": len(done) / sim_duration if duration > 0 else math.nan,
        "ttfb": _stats([r.ttfb for r in done if r.ttfb is not None], time_scale),
        "ttft": _stats([r.ttft for r in done if r.ttft is not None], time_scale),
        "itl": _stats([g for r in done for g in r.itl], time_scale),
        "tpot": _stats([t for r in done if (t := r.tpot) is not None], time_scale),
        "e2e": _stats([r.e2e for r in done if r.e2e is not None], time_scale),
    }
    deployed = [r.deployed_ttft(time_scale) for r in done if r.ttft is not None]
    if deployed and all(t is not None for t in deployed):
        summary["ttft_deployed"] = _stats([t for t in deployed if t is not None], 1.0)
    if slo is not None:
        good = sum(r.output_tokens for r in done if slo.met(r, time_scale))
        summary["goodput_tok_s"] = good / sim_duration if duration > 0 else math.nan
        summary["slo_met"] = sum(1 for r in done if slo.met(r, time_scale))
        summary["slo"] = asdict(slo)
    pools = sorted({r.pool for r in results if r.pool})
    if pools:
        summary["by_pool"] = {p: sum(1 for r in results if r.pool == p) for p in pools}
    error_kinds = sorted({r.error for r in results if r.error})
    if error_kinds:
        summary["error_kinds"] = error_kinds[:10]
    return summary


_CSV_FIELDS = [f.name for f in fields(RequestResult) if f.name != "itl"] + [
    "tpot", "itl_mean", "itl_max"]


def result_row(r: RequestResult) -> dict[str, Any]:
    row = {name: getattr(r, name) for name in _CSV_FIELDS[:-3]}
    row["tpot"] = r.tpot
    row["itl_mean"] = sum(r.itl) / len(r.itl) if r.itl else None
    row["itl_max"] = max(r.itl) if r.itl else None
    return row


def write_csv(path: Path | str, results: Iterable[RequestResult],
              extra: dict[str, Any] | None = None) -> None:
    """One row per request (raw wall-clock seconds); `extra` columns repeat per row."""
    write_tagged_csv(path, [(extra or {}, r) for r in results])


def write_tagged_csv(path: Path | str,
                     rows: Sequence[tuple[dict[str, Any], RequestResult]]) -> None:
    """One row per request, each with its own leading tag columns (e.g. concurrency)."""
    tags = list(dict.fromkeys(k for tag, _ in rows for k in tag))
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*tags, *_CSV_FIELDS])
        writer.writeheader()
        for tag, r in rows:
            writer.writerow({**tag, **result_row(r)})


def _finite(value: Any) -> Any:
    """JSON has no NaN: write null instead, so any JSON reader can load the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path | str, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(_finite(payload), fh, indent=2, sort_keys=False)
        fh.write("\n")
