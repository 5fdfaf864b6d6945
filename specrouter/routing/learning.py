"""What the router learns of each group while it routes: the online cost model
(`routing/online.py`) fed with engine windows, the group's sustained load, and its
traffic context (where a cost probe decodes and a seed with a context axis is read).

Fed by the `BackendMonitor` (telemetry samples, in-flight changes); read by the
decisions. No I/O: samples and times come in.

The sustained load is a time-weighted exponential average of the router's in-flight
count of the group's client requests (its own cost and goodput probes left out), with
time constant `sustained_s`: a short overlap of two requests moves it little, a load
held for a few time constants moves it all the way.

A window's wall time holds its `DECODE_LOG_BATCHES` decode steps and the prefill batches
run between them, so its step reads dear by the prefill's time over the steps. That time
grows with the arrival rate and so with the load: uncorrected, a pool read under
traffic (unique prompts at 12.5 req/s on H200: a third of the GPU's time) looks dearer
than one read idle by a cost probe, and the model prefers the pool read least. Each
reading is taken net of the prefill the router sent its engine within the window: the
uncached prompt tokens by the router's estimate (`Target.prefill_tokens`) times
`prefill_ms_per_token`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from specrouter.observe.loadview import (
    ACCEPT_MAX_AGE_S,
    HISTORY_S,
    BackendLoad,
    EngineSample,
    LoadView,
)
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.online import LearnedCostModel, OnlineCostModel, step_ms

#: A window counts for a pool's curve when its engine had requests in flight this share of
#: the window (SGLang's wall time would otherwise include idle gaps); for a mixed reading
#: the other engine too, and for a solo one the other had none at any moment.
BUSY_SHARE = 0.95
#: SGLang sets `gen_throughput` at every this many decode batches (its decode log
#: interval, 40 by default): a window is that many steps plus the prefills between them.
DECODE_LOG_BATCHES = 40
#: A window whose estimated prefill takes more than this share of it is no reading: the
#: step left would rest more on the estimate than on the engine's figure.
MAX_PREFILL_SHARE = 0.6


@dataclass
class PrefillLog:
    """The uncached prompt tokens the router sent one backend, by time (HISTORY_S kept)."""

    admitted: deque[tuple[float, float]] = field(default_factory=deque)

    def record(self, now: float, tokens: float) -> None:
        if tokens > 0:
            self.admitted.append((now, tokens))
        while self.admitted and self.admitted[0][0] <= now - HISTORY_S:
            self.admitted.popleft()

    def tokens(self, start: float, end: float) -> float:
        """Tokens sent within (start, end]."""
        return sum(n for t, n in self.admitted if start < t <= end)


def decode_batch(inflight: float, polled_running: float, cap: int | None) -> float:
    """The batch a window's steps decoded: the router's mean in-flight count, but no more
    than the engine's mean running count as polled within the window (requests waiting or
    being prefilled are in flight and not in the decode batch: SGLang's
    `num_running_reqs` is its running batch) nor than the batch cap."""
    batch = min(inflight, float(cap)) if cap else inflight
    return min(batch, polled_running) if polled_running > 0 else batch


@dataclass
class TrafficContext:
    """The mean prompt tokens of the generations sent to a group, each weighing half as
    much every `half_life_s`: the context a cost probe decodes at (`routing/costprobe.py`)
    and a seed with a context axis is read at (`OnlineCostModel.note_context`)."""

    half_life_s: float = 60.0
    weight: float = 0.0
    tokens: float = 0.0
    at: float | None = None

    def record(self, now: float, prompt_tokens: float) -> None:
        if self.at is not None and now > self.at:
            k = 0.5 ** ((now - self.at) / self.half_life_s)
            self.weight, self.tokens = self.weight * k, self.tokens * k
        self.at = now if self.at is None else max(self.at, now)
        self.weight += 1.0
        self.tokens += prompt_tokens

    @property
    def mean(self) -> float | None:
        return self.tokens / self.weight if self.weight > 0 else None


@dataclass
class SustainedLoad:
    """Time-weighted exponential average of a count that changes by steps: it rises with
    time constant `tau_s` and falls with `fall_tau_s` (`tau_s` when None)."""

    tau_s: float
    fall_tau_s: float | None = None
    value: float = 0.0
    count: float = 0.0  # the count in force since `at`
    at: float | None = None

    def at_time(self, now: float) -> float:
        if self.at is None or now <= self.at:
            return self.value
        tau = (self.fall_tau_s if self.fall_tau_s is not None and self.count < self.value
               else self.tau_s)
        k = math.exp(-(now - self.at) / tau)
        return self.count + (self.value - self.count) * k

    def step(self, now: float, count: float) -> None:
        self.value = self.at_time(now)
        self.count, self.at = count, now if self.at is None else max(self.at, now)


class LearnedModels(Mapping[str, GroupCostModel]):
    """The groups' learned cost models, read at the time of each lookup."""

    def __init__(self, learning: CostLearning, clock: Callable[[], float]) -> None:
        self._learning, self._clock = learning, clock

    def __getitem__(self, group: str) -> GroupCostModel:
        if group not in self._learning.groups:
            raise KeyError(group)
        return self._learning.model(group, self._clock())

    def __iter__(self) -> Iterator[str]:
        return iter(self._learning.groups)

    def __len__(self) -> int:
        return len(self._learning.groups)


class CostLearning:
    """Per group: its online cost model and its sustained load. One event loop."""

    def __init__(self, view: LoadView, *, half_life_s: float = 300.0,
                 prior_weight: float = 4.0, sustained_s: float = 5.0,
                 sustained_fall_s: float | None = None,
                 prefill_ms_per_token: float = 0.0, kv_room: bool = False) -> None:
        self.view = view
        self.half_life_s, self.prior_weight, self.kv_room = half_life_s, prior_weight, kv_room
        self.prefill_ms_per_token = prefill_ms_per_token
        self._prefills: dict[str, PrefillLog] = {}
        groups = view.group_names()
        self._learners = {g: OnlineCostModel(half_life_s=half_life_s, prior_weight=prior_weight,
                                             kv_room=kv_room)
                          for g in groups}
        self._sustained = {g: SustainedLoad(sustained_s, sustained_fall_s) for g in groups}
        self._own_inflight = dict.fromkeys(groups, 0)  # the router's own requests in flight
        self._contexts = {g: TrafficContext() for g in groups}
        self._windows: dict[str, tuple[float, float]] = {}  # backend -> (rate, first seen)
        # backend -> (sum, count) of the engine's running counts polled in its current window
        self._running: dict[str, tuple[int, int]] = {}

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self._learners)

    def seed(self, models: Mapping[str, GroupCostModel]) -> None:
        """Configured models become the strong prior of their groups' learners."""
        for group, model in models.items():
            if group in self._learners:
                self._learners[group] = OnlineCostModel(
                    model, half_life_s=self.half_life_s, prior_weight=self.prior_weight,
                    kv_room=self.kv_room)

    def model(self, group: str, now: float) -> LearnedCostModel:
        return self._learners[group].model(now)

    def learner(self, group: str) -> OnlineCostModel:
        return self._learners[group]

    def sustained(self, group: str, now: float) -> float:
        return self._sustained[group].at_time(now)

    def traffic_context(self, group: str) -> float | None:
        """The mean prompt tokens of the generations lately sent to `group` (None: none
        with a known prompt yet)."""
        return self._contexts[group].mean

    def models(self, seeds: Mapping[str, GroupCostModel],
               clock: Callable[[], float]) -> LearnedModels:
        """Every group's learned model at `clock()`, `seeds` seeding theirs."""
        self.seed(seeds)
        return LearnedModels(self, clock)

    # -- feeds ---------------------------------------------------------------------------

    def inflight_changed(self, backend: str, now: float, own_change: int = 0) -> None:
        """`backend`'s in-flight count changed; `own_change` of it was the router's own
        requests (cost and goodput probes), which the sustained load leaves out: it
        stands for the clients' demand, and a probe is none (a cost probe starts only on
        an idle group and a client's request cancels it; a goodput probe copies a request
        already counted)."""
        group = self.view.backends[backend].group
        self._own_inflight[group] += own_change
        clients = self.view.group_inflight(group) - self._own_inflight[group]
        self._sustained[group].step(now, float(clients))

    def admitted(self, backend: str, now: float, prefill_tokens: float,
                 prompt_tokens: float = 0.0) -> None:
        """A request went to `backend` with this many prompt tokens to prefill there, of
        `prompt_tokens` in all (0: not known, or not a client's generation)."""
        prefills = self._prefills.get(backend)
        if prefills is None:
            prefills = self._prefills[backend] = PrefillLog()
        prefills.record(now, prefill_tokens)
        if prompt_tokens > 0:
            group = self.view.backends[backend].group
            self._contexts[group].record(now, prompt_tokens)
            self._learners[group].note_context(self._contexts[group].mean)

    def sample(self, backend: str, sample: EngineSample) -> None:
        """A telemetry sample of `backend`: its load readings set the pool's batch cap
        (`OnlineCostModel.note_load`); a new engine window is a reading of its step cost
        (each window once: SGLang's gauge keeps its value until the next decode log)."""
        b = self.view.backends[backend]
        learner = self._learners[b.group]
        learner.note_max_batch(b.pool, sample.max_running)
        learner.note_load(b.pool, sample.running, sample.waiting, sample.received_at,
                          sample.kv_tokens, sample.kv_used)
        rate = sample.gen_throughput
        if rate is None:
            return
        prev = self._windows.get(backend)
        total, polls = self._running.get(backend, (0, 0))
        if prev is not None and prev[0] == rate:
            self._running[backend] = (total + sample.running, polls + 1)
            return
        self._windows[backend] = (rate, sample.received_at)
        polled = (total + sample.running) / (polls + 1)
        self._running[backend] = (0, 0)
        if prev is None or rate <= 0:
            return
        # the window's ends are known to a poll: widen it by one so no idle gap is missed
        start, end = prev[1] - self.view.poll_interval, sample.received_at
        if b.history.busy_share(start, end) < BUSY_SHARE:
            return
        tokens = self._tokens_per_step(b, end)
        if tokens is None:
            return
        batch = decode_batch(b.history.mean(prev[1], end), polled,
                             learner.model_cap(b.pool, end))
        ms = step_ms(batch, tokens, rate)
        if ms is None:
            return
        others = [o for o in self.view.backends.values()
                  if o.group == b.group and o.pool != b.pool]
        # the engine's windows end at its decode logs, which a poll sees half an interval
        # late on average: the prefills of the window were sent that much earlier
        lag = self.view.poll_interval / 2
        prefill = sum(log.tokens(prev[1] - lag, end - lag) for o in (b, *others)
                      if (log := self._prefills.get(o.name)) is not None)
        ms = self._net_of_prefill(ms, prefill)
        if ms is None:
            return
        other_busy = max((o.history.busy_share(start, end) for o in others), default=0.0)
        engine_busy = any(o.sample is not None and o.sample.total > 0
                          and o.sample.received_at >= start for o in others)
        if other_busy == 0.0 and not engine_busy:
            learner.observe(b.pool, batch, ms, end)
        elif other_busy >= BUSY_SHARE and others:
            other_batch = sum(o.history.mean(prev[1], end) for o in others)
            eagle, base = (batch, other_batch) if b.pool == "eagle" else (other_batch, batch)
            accept = self._accept(others[0], end) if b.pool == "baseline" else tokens
            learner.observe_mixed(eagle, base, ms, accept or learner.nominal_accept_length, end)

    def _net_of_prefill(self, window_step_ms: float, prefill_tokens: float) -> float | None:
        """A window's step without its share of the prefill sent within it (None: the
        prefill would be most of the window)."""
        prefill_ms = prefill_tokens * self.prefill_ms_per_token / DECODE_LOG_BATCHES
        if prefill_ms > MAX_PREFILL_SHARE * window_step_ms:
            return None
        return window_step_ms - prefill_ms

    def _tokens_per_step(self, b: BackendLoad, now: float) -> float | None:
        return 1.0 if b.pool == "baseline" else self._accept(b, now)

    @staticmethod
    def _accept(b: BackendLoad, now: float) -> float | None:
        """The EAGLE-3 backend's windowed accept length while fresh."""
        if b.pool != "eagle" or b.accept_length is None or b.accept_seen_at is None:
            return None
        return b.accept_length if now - b.accept_seen_at <= ACCEPT_MAX_AGE_S else None
