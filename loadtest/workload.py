"""Open-loop workloads as data: arrival times and request lengths, drawn from a seed.

A workload is a list of `Arrival`s (simulated seconds from the start, prompt tokens,
output tokens), fixed before a run, so every configuration measured replays exactly the
same requests at exactly the same moments. Pure: no I/O, no clock.

- Poisson arrivals at a rate: independent users.
- On/off modulated Poisson: Poisson at `on_rate` during on periods and at `off_rate`
  during off periods of fixed lengths (a square wave of demand); since Poisson arrivals
  are memoryless, restarting the draws at each period boundary is exact.
- Lengths: lognormal (a heavy right tail, as chat and coding outputs have), clipped to
  `[low, high]`; with `ignore_eos` the output length is what the engine generates.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthDist:
    """Token counts: round(lognormal(ln median, sigma)) clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0:
            raise ValueError("a length distribution needs median > 0 and sigma >= 0")
        if not 1 <= self.low <= self.high:
            raise ValueError("a length distribution needs 1 <= low <= high")

    def draw(self, rng: random.Random) -> int:
        value = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(self.high, max(self.low, round(value)))

    def mean(self) -> float:
        """E[clip(X, low, high)] for X lognormal (before rounding, which moves it by
        well under one token)."""
        if self.sigma == 0:
            return float(min(self.high, max(self.low, self.median)))
        mu, s = math.log(self.median), self.sigma

        def cdf(z: float) -> float:
            return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

        lo, hi = math.log(self.low), math.log(self.high)
        below = cdf((lo - mu) / s)
        above = 1.0 - cdf((hi - mu) / s)
        inside = math.exp(mu + s * s / 2) * (cdf((hi - mu - s * s) / s)
                                             - cdf((lo - mu - s * s) / s))
        return self.low * below + inside + self.high * above


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: when it arrives (simulated s) and its lengths."""

    t: float
    input_tokens: int
    output_tokens: int


def poisson_times(rate: float, count: int, rng: random.Random) -> list[float]:
    """`count` arrival times of a Poisson process at `rate` per second, from 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    times: list[float] = []
    t = 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass(frozen=True)
class OnOff:
    """A square wave of demand: `cycles` x (on_s at on_rate, then off_s at off_rate)."""

    on_rate: float
    off_rate: float
    on_s: float
    off_s: float
    cycles: int

    def __post_init__(self) -> None:
        if self.on_rate <= 0 or self.off_rate < 0:
            raise ValueError("on/off rates: on_rate > 0 and off_rate >= 0")
        if self.on_s <= 0 or self.off_s < 0 or self.cycles < 1:
            raise ValueError("on/off periods: on_s > 0, off_s >= 0, cycles >= 1")

    @property
    def duration_s(self) -> float:
        return self.cycles * (self.on_s + self.off_s)

    def expected_count(self) -> float:
        return self.cycles * (self.on_rate * self.on_s + self.off_rate * self.off_s)

    def rate_at(self, t: float) -> float:
        within = t % (self.on_s + self.off_s)
        return self.on_rate if within < self.on_s else self.off_rate

    def times(self, rng: random.Random) -> list[float]:
        """Arrival times of the modulated Poisson process over all cycles."""
        times: list[float] = []
        start = 0.0
        for _ in range(self.cycles):
            for rate, length in ((self.on_rate, self.on_s), (self.off_rate, self.off_s)):
                t = start
                while rate > 0:
                    t += rng.expovariate(rate)
                    if t >= start + length:
                        break
                    times.append(t)
                start += length
        return times


def with_lengths(times: Sequence[float], inputs: LengthDist, outputs: LengthDist,
                 rng: random.Random) -> list[Arrival]:
    """Arrivals at `times`, each with its own prompt and output length."""
    return [Arrival(t, inputs.draw(rng), outputs.draw(rng)) for t in times]


def poisson_workload(rate: float, count: int, inputs: LengthDist, outputs: LengthDist,
                     seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    return with_lengths(poisson_times(rate, count, rng), inputs, outputs, rng)


def onoff_workload(pattern: OnOff, inputs: LengthDist, outputs: LengthDist,
                   seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    return with_lengths(pattern.times(rng), inputs, outputs, rng)
