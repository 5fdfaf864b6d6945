"""What a calibration sweep measures: each level's requests, and what the servers said."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LevelResult:
    """The requests of one pool at one concurrency level."""

    pool: str
    concurrency: int
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list, repr=False)
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    # (first token, end, tokens) of each request, on the perf_counter clock
    spans: list[tuple[float, float, int]] = field(default_factory=list, repr=False)
    # the level's measuring window with a duration: (start, deadline)
    window: tuple[float, float] | None = None

    @property
    def throughput_tok_s(self) -> float:
        """With a duration, the tokens decoded inside [start, deadline] per second: the
        level at exactly C in flight. The tail after the deadline (C falling to 0) is left
        out: requests ending unevenly would bias one pool by more than the gap between
        the pools near the crossover."""
        if self.window is not None:
            start, end = self.window
            inside = sum(tokens * _overlap(first, last, start, end)
                         for first, last, tokens in self.spans)
            return inside / (end - start) if end > start else 0.0
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def median_latency_s(self) -> float | None:
        return statistics.median(self.latencies_s) if self.latencies_s else None

    @property
    def p90_latency_s(self) -> float | None:
        return _quantile(self.latencies_s, 0.9)

    @property
    def median_ttft_s(self) -> float | None:
        return statistics.median(self.ttfts_s) if self.ttfts_s else None

    def summary(self) -> dict[str, Any]:
        return {"pool": self.pool, "concurrency": self.concurrency, "requests": self.requests,
                "errors": self.errors, "output_tokens": self.output_tokens,
                "wall_s": round(self.wall_s, 4),
                "throughput_tok_s": round(self.throughput_tok_s, 2),
                "median_latency_s": self.median_latency_s, "p90_latency_s": self.p90_latency_s,
                "median_ttft_s": self.median_ttft_s}


@dataclass
class SweepFacts:
    """What the servers reported during the sweep: the EAGLE accept length after each of
    its levels (None where it reported none) and each pool's max running requests."""

    accept_by_level: dict[int, float | None] = field(default_factory=dict)
    max_running: dict[str, int | None] = field(default_factory=dict)

    @property
    def accept_length(self) -> float | None:
        """Mean over the levels that reported one: the accept length the sweep ran at."""
        values = [a for a in self.accept_by_level.values() if a is not None and a > 0]
        return statistics.fmean(values) if values else None


def crossover(eagle: Sequence[LevelResult], baseline: Sequence[LevelResult]) -> float | None:
    """First concurrency where baseline throughput >= EAGLE's, interpolated linearly in the
    throughput ratio from the last level EAGLE was ahead. 0.0: baseline ahead everywhere;
    None: EAGLE ahead at every level."""
    pairs = sorted(((e.concurrency, ratio(e, b)) for e, b in zip(eagle, baseline, strict=True)))
    prev: tuple[int, float] | None = None
    for level, level_ratio in pairs:
        if level_ratio <= 1.0:
            if prev is None:
                return 0.0
            c0, r0 = prev
            return c0 + (r0 - 1.0) / (r0 - level_ratio) * (level - c0)
        prev = (level, level_ratio)
    return None


def ratio(eagle: LevelResult, baseline: LevelResult) -> float:
    """EAGLE-3's output throughput over the baseline's at one level."""
    if baseline.throughput_tok_s <= 0:
        return math.inf
    return eagle.throughput_tok_s / baseline.throughput_tok_s


def _overlap(first: float, last: float, start: float, end: float) -> float:
    """The share of a request's decode span [first, last] inside [start, end] (its tokens
    taken as evenly spread over the span)."""
    if last <= first:
        return 1.0 if start <= last <= end else 0.0
    return max(0.0, min(last, end) - max(first, start)) / (last - first)


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
