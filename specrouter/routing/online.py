"""The online cost model of one GPU group: each pool's step cost, learned from telemetry.

Pure: readings come in as numbers with their time, the model goes out as a
`GroupCostModel`. `routing/monitor.py` turns engine samples into readings.

A reading is one engine window (SGLang logs its decode stats every 40 decode batches and
sets `gen_throughput` = tokens of the window / wall time since the previous log): with B
requests decoding and t tokens per request per step (1 on the baseline, the windowed
accept length on EAGLE-3), one step took

    step_ms = 1000 * B * t / gen_throughput

The wall time includes idle gaps, prefill batches and the other engine's GPU time slices,
so only windows whose engine was busy throughout count. A window where the group's other
server was idle throughout is a solo reading of the pool's curve; one where the other was
busy throughout measures the mixing cost (a round of both engines, SGLang's two CUDA
contexts time-sliced); any other window is dropped.

Each pool's curve is a weighted least-squares fit with exponential forgetting (half-life
`half_life_s`) plus pseudo-readings of a prior:
- without a configured model the curve is a line a + b*B; the prior is a shape whose level
  follows the pool's own readings (so a pool seen at one batch size gets the prior's
  slope-to-intercept ratio, and readings at several sizes outweigh it), and the pool with
  fewer readings takes the other pool's fit through `TRANSFER` as its shape, moved (not
  scaled) to pass through the mean of its own readings: readings at one batch size (a
  cost probe's, `routing/costprobe.py`) set its intercept and keep the transferred slope,
  the ratio that holds across the measured tables;
- with a configured model (calibration, profile, step table) the curve is that model's
  curve times a learned factor per pool: the group's level, learned from both pools'
  readings at once, times the pool's ratio to it, whose strong prior is the seed's. A
  seed's ratio of the pools holds until each pool's own readings say otherwise. A seed
  measured at several contexts (`ContextCostModel`) is read at the group's traffic
  context (`note_context`), and each reading is compared with it there.

Each pool's batch cap (`GroupCostModel.predict` counts the requests beyond it as queued)
is the engine's max running requests, or fewer while its KV pool bounds the batch: an
engine that queues (`num_waiting_reqs` > 0) below its max with its KV pool nearly full
(`num_used_tokens` >= `ROOM_FULL_SHARE` of `max_total_num_tokens`) holds about the
requests it runs, so its pool over that count is what a request takes (`_Room`), and
each pool's cap is its own pool over that: the engine's running count for the engine
that queued, its share of the KV for the other, which has not queued yet. The caps
recover toward the engines' max with half-life `room_half_life_s` from the last such
reading, and never sit below a running count an engine reported since. With `kv_room`
off (the router's default, `telemetry.learn_kv_room`) the model keeps the engines' max
and the room is only shown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specrouter.backends import Pool, other_pool
from specrouter.routing.costmodel import ContextCostModel, GroupCostModel, PolyCurve, StepCurve
from specrouter.routing.costprobe import contexts_differ

#: Batch sizes of the prior's pseudo-readings.
PRIOR_BATCHES = (1.0, 4.0)
#: Shape of the prior EAGLE-3 line (ms = a * (1 + slope_ratio * B)) and its level before any
#: reading: the level only sets the units, the ratio the extrapolation of one batch size.
PRIOR_EAGLE = PolyCurve(10.0, 0.5)
#: The baseline's step against EAGLE-3's at the same batch: intercept / 1.7 (no draft model,
#: one-token verify) and slope / 5 (one token per request per step instead of the draft
#: tokens plus the draft steps). Measured tables: seed-coding 1.8 and 5.0, H200 Llama-3.1-8B
#: 1.35 and 5.6 (docs/policy.md).
TRANSFER = (1.7, 5.0)
#: Pseudo-readings of a seed's level (its ratio of the pools weighs `seed_weight`).
SEED_LEVEL_WEIGHT = 1.0
#: Share of a half-life within which a built model is served again (`model`).
REUSE_HALF_LIFE_SHARE = 1e-3
#: A reading's batch below this counts as this (an engine that just started a request).
MIN_BATCH = 1.0
#: An engine that queues below its max running requests is bound by its KV pool when at
#: least this share of the pool is in use. A queue behind a chunked prefill (a 30k-token
#: prompt takes four 8,192-token chunks) shows at any fill; a request that did not fit
#: shows with the pool full but for the output share SGLang reserves per running request
#: and the head request's own prompt (the simulator's agentic runs: 0.81-0.99 when bound,
#: 0.1-0.6 behind a prefill).
ROOM_FULL_SHARE = 0.75
#: Half-life of a pool's effective batch cap's recovery toward the engine's max, seconds.
ROOM_HALF_LIFE_S = 30.0
#: A seed with a context axis is read again once the traffic's context moved this share
#: away from the one it was read at (a step's cost moves by less than that share).
CONTEXT_STEP = 0.05


@dataclass(frozen=True)
class ScaledCurve:
    """A configured curve times a learned factor."""

    base: StepCurve
    factor: float

    def ms(self, batch: float) -> float:
        return max(1e-6, self.factor * self.base.ms(batch))


@dataclass
class _Fit:
    """Decayed weighted sums of one pool's readings in a basis of one or two functions."""

    # w, wx, wy, then for a line the normal equations of a + b*B (A: 2x2, r: 2); for a
    # seeded curve A[0] = w and r[0] = sum of w * reading / seed
    sums: list[float] = field(default_factory=lambda: [0.0] * 9)
    at: float | None = None
    readings: int = 0
    low: float = math.inf
    high: float = 0.0

    def decay(self, now: float, half_life: float) -> None:
        if self.at is not None and now > self.at:
            k = 0.5 ** ((now - self.at) / half_life)
            self.sums = [s * k for s in self.sums]
        self.at = now if self.at is None else max(self.at, now)

    @property
    def weight(self) -> float:
        return self.sums[0]

    def mean(self) -> tuple[float, float] | None:
        w = self.sums[0]
        return None if w <= 1e-9 else (self.sums[1] / w, self.sums[2] / w)


@dataclass
class _Room:
    """The KV tokens a running request takes in the group (its context, cached prefix and
    the output SGLang reserves): the engine's KV pool over its running count at the last
    KV-bound queueing reading. A workload's property, so it bounds both pools' batches,
    each at its own pool's `max_total_num_tokens` over it. Recovers toward the engines'
    max in time (a time decay, not a count of readings: the router polls the same engine
    snapshot several times, and idle engines are polled as often as busy ones)."""

    footprint: float | None = None  # None: no KV-bound reading yet
    at: float = 0.0

    def cap(self, engine_max: int | None, kv_tokens: int | None, now: float,
            half_life: float) -> int | None:
        if engine_max is None or kv_tokens is None or self.footprint is None:
            return engine_max
        bound = min(float(engine_max), kv_tokens / self.footprint)
        k: float = 0.5 ** (max(0.0, now - self.at) / half_life)
        return min(engine_max, max(1, round(engine_max - (engine_max - bound) * k)))


def kv_bound(running: int, waiting: int, engine_max: int, kv_tokens: int | None,
             kv_used: int | None) -> bool:
    """Whether a reading shows the KV pool, not the max running requests, bounding the
    batch: requests wait while fewer than the max run and the pool is nearly full."""
    return (waiting > 0 and 0 < running < engine_max and kv_tokens is not None
            and kv_tokens > 0 and kv_used is not None
            and kv_used >= ROOM_FULL_SHARE * kv_tokens)


@dataclass(frozen=True)
class LearnedPool:
    """One pool's learned curve and what it rests on (for GET /policy and /metrics)."""

    curve: StepCurve
    readings: int  # windows folded in (since a probe at another context replaced them)
    weight: float  # their decayed weight
    prior_weight: float  # the prior's pseudo-readings
    batch_range: tuple[float, float] | None  # smallest and largest batch seen
    probes: int = 0  # readings a cost probe measured (proxy/shadow.py CostProber)
    probe_context: float | None = None  # prompt tokens the last probe decoded at
    read_since_probe: int = 0  # telemetry windows folded in since that probe

    @property
    def prior_share(self) -> float:
        """How much of the fit is still the prior (1: no reading yet)."""
        return self.prior_weight / (self.prior_weight + self.weight)

    def as_dict(self) -> dict[str, Any]:
        c = self.curve
        shape: dict[str, Any] = ({"a": round(c.a, 4), "b": round(c.b, 5)}
                                 if isinstance(c, PolyCurve) else
                                 {"seed_factor": round(c.factor, 4)}
                                 if isinstance(c, ScaledCurve) else {})
        return {**shape, "step_ms_at": {str(b): round(c.ms(b), 3) for b in (1, 8, 32)},
                "readings": self.readings, "probes": self.probes,
                "probe_context_tokens": self.probe_context, "weight": round(self.weight, 2),
                "prior_share": round(self.prior_share, 3),
                "batch_range": None if self.batch_range is None else list(self.batch_range)}


@dataclass(frozen=True)
class LearnedCostModel(GroupCostModel):
    """A group cost model with what it was learned from (GET /policy shows it)."""

    pools: Mapping[Pool, LearnedPool] = field(default_factory=dict)
    seeded: bool = False
    mixing_ratio: float | None = None
    mixed_readings: int = 0
    # cost probes by (pool, outcome): read, cancelled (a request came), failed
    probes: Mapping[tuple[Pool, str], int] = field(default_factory=dict)
    # each engine's max running requests (the batch caps above are these or its KV room)
    engine_max_batch: Mapping[Pool, int | None] = field(default_factory=dict)
    # each engine's KV room (`OnlineCostModel.batch_cap`), whether the caps above use it
    # or not (`kv_room`)
    kv_room_batch: Mapping[Pool, int | None] = field(default_factory=dict)
    # the prompt tokens a seed with a context axis is read at (None: no such seed, or
    # no traffic yet: its smallest context)
    context: float | None = None

    def describe(self, accept_length: float) -> dict[str, Any]:
        caps = {"eagle": self.eagle_max_batch, "baseline": self.baseline_max_batch}
        return {"seeded": self.seeded, "pools": {p: v.as_dict() for p, v in self.pools.items()},
                "batch_cap": {p: {"effective": caps[p], "engine": self.engine_max_batch.get(p),
                                  "kv_room": self.kv_room_batch.get(p)}
                              for p in ("eagle", "baseline")},
                "mixing_ratio": None if self.mixing_ratio is None else round(self.mixing_ratio, 3),
                "mixed_readings": self.mixed_readings,
                "probes": {f"{p}/{o}": n for (p, o), n in sorted(self.probes.items())},
                "context_tokens": None if self.context is None else round(self.context),
                "crossover": self.crossover(accept_length)}


class OnlineCostModel:
    """The learner of one group. Mutable; one event loop."""

    def __init__(self, seed: GroupCostModel | None = None, *, half_life_s: float = 300.0,
                 prior_weight: float = 8.0, seed_weight: float = 64.0,
                 nominal_accept_length: float = 2.0,
                 room_half_life_s: float = ROOM_HALF_LIFE_S, kv_room: bool = False) -> None:
        if min(half_life_s, prior_weight, seed_weight, room_half_life_s) <= 0:
            raise ValueError("half_life_s, prior_weight, seed_weight and room_half_life_s "
                             "must be positive")
        self.seed = seed
        self.half_life_s = half_life_s
        self.prior_weight = seed_weight if seed is not None else prior_weight
        self.nominal_accept_length = (seed.nominal_accept_length if seed is not None
                                      else nominal_accept_length)
        self._fits: dict[Pool, _Fit] = {"eagle": _Fit(), "baseline": _Fit()}
        self.max_batch: dict[Pool, int | None] = {
            "eagle": None if seed is None else seed.eagle_max_batch,
            "baseline": None if seed is None else seed.baseline_max_batch}
        self.room_half_life_s, self.kv_room = room_half_life_s, kv_room
        self.kv_tokens: dict[Pool, int | None] = {"eagle": None, "baseline": None}
        self._room = _Room()
        self.mixing: float | None = None  # observed mixed round / predicted sum
        self.mixed_readings = 0
        self.probes: dict[tuple[Pool, str], int] = {}
        self.probe_context: dict[Pool, float | None] = {"eagle": None, "baseline": None}
        self.read_since_probe: dict[Pool, int] = {"eagle": 0, "baseline": 0}
        self.context: float | None = None
        self._cache: tuple[float, LearnedCostModel] | None = None

    # -- readings ------------------------------------------------------------------------

    def observe(self, pool: Pool, batch: float, step_ms: float, now: float,
                weight: float = 1.0, *, probe: bool = False,
                context: float | None = None) -> None:
        """A solo window of `pool`: `batch` requests decoding, steps of `step_ms`
        (`context`: a cost probe's reading at that many prompt tokens, 0 when not known,
        and not a telemetry window; `probe`: this replica's own, counted as the probe's
        `read` outcome)."""
        if not (step_ms > 0 and math.isfinite(step_ms) and batch > 0 and weight > 0):
            return
        batch = max(MIN_BATCH, batch)
        if context is None:
            self.read_since_probe[pool] += 1
        else:
            self._probed_at(pool, context)
        fit = self._fits[pool]
        fit.decay(now, self.half_life_s)
        s = fit.sums
        s[0] += weight
        s[1] += weight * batch
        s[2] += weight * step_ms
        if self.seed is not None:  # the factor: a weighted mean of reading / seed
            s[3] += weight
            s[7] += weight * step_ms / self._seed_curve(pool, context or None).ms(batch)
        else:
            for i, phi_i in enumerate((1.0, batch)):
                for j, phi_j in enumerate((1.0, batch)):
                    s[3 + i * 2 + j] += weight * phi_i * phi_j
                s[7 + i] += weight * phi_i * step_ms
        fit.readings += 1
        if probe:
            self.note_probe(pool, "read")
        fit.low, fit.high = min(fit.low, batch), max(fit.high, batch)
        self._cache = None

    def _probed_at(self, pool: Pool, context: float) -> None:
        """A probe reading at `context`: one this far from the pool's last probe replaces
        the pool's readings, which describe decoding at another context."""
        self.read_since_probe[pool] = 0
        if context <= 0:
            return
        last = self.probe_context[pool]
        if last is not None and contexts_differ(last, context):
            self._fits[pool] = _Fit()
        self.probe_context[pool] = context

    def observe_mixed(self, eagle_batch: float, baseline_batch: float, round_ms: float,
                      accept_length: float, now: float) -> None:
        """A window where both engines decoded throughout: `round_ms` is one engine's step
        as it saw it (its own step plus the other's in between)."""
        if not (round_ms > 0 and math.isfinite(round_ms)):
            return
        m = self.model(now, accept_length)
        predicted = m.eagle.ms(max(MIN_BATCH, eagle_batch)) + m.baseline.ms(
            max(MIN_BATCH, baseline_batch))
        ratio = round_ms / predicted
        self.mixing = ratio if self.mixing is None else 0.8 * self.mixing + 0.2 * ratio
        self.mixed_readings += 1
        self._cache = None

    def note_context(self, context: float | None) -> None:
        """The mean prompt tokens of the group's recent traffic: where a seed with a
        context axis is read (again once it moved `CONTEXT_STEP` away)."""
        if not isinstance(self.seed, ContextCostModel) or context is None or context <= 0:
            return
        if self.context is None or abs(context - self.context) > CONTEXT_STEP * self.context:
            self.context = context
            self._cache = None

    def note_probe(self, pool: Pool, outcome: str) -> None:
        """A cost probe of `pool` ended: read, cancelled or failed."""
        self.probes[pool, outcome] = self.probes.get((pool, outcome), 0) + 1
        self._cache = None

    def note_max_batch(self, pool: Pool, max_running: int | None) -> None:
        """The engine's max running requests as its telemetry reports it."""
        if max_running is not None and max_running > 0 and self.max_batch[pool] is None:
            self.max_batch[pool] = max_running
            self._cache = None

    def note_load(self, pool: Pool, running: int, waiting: int, now: float,
                  kv_tokens: int | None = None, kv_used: int | None = None) -> None:
        """An engine's load reading: a KV-bound queue sets the group's footprint per
        request from it (so `pool`'s cap to its running count); a running count above
        `pool`'s cap shows a smaller footprint."""
        if kv_tokens is not None and kv_tokens > 0:
            self.kv_tokens[pool] = kv_tokens
        cap, kv, room = self.max_batch[pool], self.kv_tokens[pool], self._room
        if cap is None or kv is None:
            return
        before = self._caps(now)
        if kv_bound(running, waiting, cap, kv_tokens, kv_used):
            room.footprint, room.at = kv / running, now
        elif room.footprint is not None and running > (self.batch_cap(pool, now) or cap):
            room.footprint, room.at = kv / min(running, cap), now
        if self._caps(now) != before:
            self._cache = None

    def batch_cap(self, pool: Pool, now: float) -> int | None:
        """The most requests `pool`'s engine runs at once now (None: not known)."""
        return self._room.cap(self.max_batch[pool], self.kv_tokens[pool], now,
                              self.room_half_life_s)

    def model_cap(self, pool: Pool, now: float) -> int | None:
        """The cap the model predicts with: `batch_cap`, or the engine's max with
        `kv_room` off (the KV room is then only shown)."""
        return self.batch_cap(pool, now) if self.kv_room else self.max_batch[pool]

    def _caps(self, now: float) -> tuple[int | None, int | None]:
        return self.batch_cap("eagle", now), self.batch_cap("baseline", now)

    # -- the model -----------------------------------------------------------------------

    def model(self, now: float, accept_length: float | None = None) -> LearnedCostModel:
        """The group's cost model as learned by `now` (readings decayed to then). Until a
        reading arrives the model built within `REUSE_HALF_LIFE_SHARE` of a half-life is
        served again: decay moves the readings' weights by under 0.07% in that time, and a
        decision reads the model on every request."""
        if (self._cache is not None
                and abs(now - self._cache[0]) <= self.half_life_s * REUSE_HALF_LIFE_SHARE):
            return self._cache[1]
        for fit in self._fits.values():
            fit.decay(now, self.half_life_s)
        e, b = self._curves()
        pools: dict[Pool, LearnedPool] = {
            pool: LearnedPool(curve, fit.readings, fit.weight, self.prior_weight,
                              None if fit.readings == 0 else (fit.low, fit.high),
                              self.probes.get((pool, "read"), 0), self.probe_context[pool],
                              self.read_since_probe[pool])
            for pool, curve, fit in _by_pool(e, b, self._fits)}
        model = LearnedCostModel(b, e, self.nominal_accept_length,
                                 self.model_cap("baseline", now), self.model_cap("eagle", now),
                                 pools, self.seed is not None, self.mixing,
                                 self.mixed_readings, dict(self.probes),
                                 {p: self.max_batch[p] for p in ("eagle", "baseline")},
                                 {p: self.batch_cap(p, now) for p in ("eagle", "baseline")},
                                 self.context)
        self._cache = (now, model)
        return model

    def learned(self, now: float) -> Mapping[Pool, LearnedPool]:
        return self.model(now).pools

    def _seed_curve(self, pool: Pool, context: float | None = None) -> StepCurve:
        """The seed's curve of `pool` at `context` (None: the traffic's)."""
        assert self.seed is not None
        return self.seed.at_context(self.context if context is None else context).curve(pool)

    def _curves(self) -> tuple[StepCurve, StepCurve]:
        if self.seed is not None:
            seed = self.seed.at_context(self.context)
            return (ScaledCurve(seed.eagle, self._factor("eagle")),
                    ScaledCurve(seed.baseline, self._factor("baseline")))
        first: Pool = ("eagle" if self._fits["eagle"].weight >= self._fits["baseline"].weight
                       else "baseline")
        prior_first = PRIOR_EAGLE if first == "eagle" else _transfer(PRIOR_EAGLE, "baseline")
        fitted = self._line(first, prior_first)
        second = self._line(other_pool(first), _transfer(fitted, other_pool(first)), shift=True)
        return (fitted, second) if first == "eagle" else (second, fitted)

    def _factor(self, pool: Pool) -> float:
        """The group's level times the pool's own ratio to it. A seed knows the ratio of the
        pools' steps better than their level (it may come from another clock, context
        length or driver), so the level follows both pools' readings at once, and a pool's
        ratio to it moves off the seed's (the pseudo-readings at 1) only with that pool's
        own readings: a pool with no recent reading moves with the other."""
        fit = self._fits[pool]
        level = self._group_level()
        return level * (fit.sums[7] / level + self.prior_weight) / (
            fit.sums[3] + self.prior_weight)

    def _group_level(self) -> float:
        """Both pools' readings' mean of reading / seed curve (one pseudo-reading at 1)."""
        fits = self._fits.values()
        return (sum(f.sums[7] for f in fits) + SEED_LEVEL_WEIGHT) / (
            sum(f.sums[3] for f in fits) + SEED_LEVEL_WEIGHT)

    def _line(self, pool: Pool, shape: PolyCurve, shift: bool = False) -> PolyCurve:
        """Least squares of a + b*B over the readings and the prior's pseudo-readings, the
        prior's level matched to the readings' mean (`shift`: by moving the shape's
        intercept, keeping its slope); slope >= 0, intercept > 0."""
        fit = self._fits[pool]
        mean = fit.mean()
        if shift and mean is not None:
            shape = PolyCurve(max(1e-3, shape.a + mean[1] - shape.ms(mean[0])), shape.b)
        level = 1.0 if mean is None else mean[1] / shape.ms(mean[0])
        s = fit.sums
        a00, a01, a11, r0, r1 = s[3], s[4], s[6], s[7], s[8]
        share = self.prior_weight / len(PRIOR_BATCHES)
        for x in PRIOR_BATCHES:
            y = level * shape.ms(x)
            a00, a01, a11 = a00 + share, a01 + share * x, a11 + share * x * x
            r0, r1 = r0 + share * y, r1 + share * x * y
        det = a00 * a11 - a01 * a01
        if det <= 1e-12:
            return PolyCurve(level * shape.a, level * shape.b)
        a = (r0 * a11 - a01 * r1) / det
        b = (a00 * r1 - a01 * r0) / det
        if b < 0:  # a step never gets cheaper with more requests
            b, a = 0.0, r0 / a00
        if a <= 0:  # nor costs nothing with none
            a = 1e-3 * max(r0 / a00, 1e-3)
            b = max(0.0, (r1 - a * a01) / a11)
        return PolyCurve(a, b)


def _by_pool(e: StepCurve, b: StepCurve, fits: Mapping[Pool, _Fit]
              ) -> tuple[tuple[Pool, StepCurve, _Fit], ...]:
    return (("eagle", e, fits["eagle"]), ("baseline", b, fits["baseline"]))


def _transfer(curve: PolyCurve, to: Pool) -> PolyCurve:
    """The prior shape of `to` from the other pool's line (`TRANSFER`)."""
    ia, sb = TRANSFER
    if to == "baseline":
        return PolyCurve(curve.a / ia, curve.b / sb)
    return PolyCurve(curve.a * ia, curve.b * sb)


def step_ms(batch: float, tokens_per_step: float, gen_throughput: float) -> float | None:
    """One step's milliseconds from a window's throughput (None: no usable window)."""
    if batch <= 0 or tokens_per_step <= 0 or not gen_throughput > 0:
        return None
    return 1000.0 * batch * tokens_per_step / gen_throughput
