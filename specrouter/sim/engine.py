"""One simulated SGLang engine: a continuous-batching scheduler stepping on a shared GPU.

The scheduler follows SGLang's shape: new requests wait in a queue, are admitted while a batch
slot (`max_running_requests`) and KV space are free, are prefilled in chunks (prefill has
priority over decode, as in SGLang's default policy), then decode one step at a time; an EAGLE
engine's decode step is draft steps plus one verify step and yields a random number of tokens
per request. Token delivery is an asyncio.Event per request, so HTTP handlers stream each
step's tokens as one chunk, as SGLang does.

Steps are booked at absolute deadlines on the SharedGpu; a late event loop makes the next
sleep shorter rather than pushing every later step back, so the simulated clock keeps pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

from specrouter.sim import physics
from specrouter.sim.gpu import SharedGpu
from specrouter.sim.profile import EngineDefaults, Profile
from specrouter.sim.text import WordStream

LOADS_PUBLISH_STEPS = 15  # SGLang --load-snapshot-publish-interval default
METRICS_LOG_STEPS = 40  # SGLang --decode-log-interval default: gauges refresh this often
ACCEPT_WINDOW_STEPS = 40
MAX_CATCH_UP_REAL_S = 0.25  # beyond this the loop is overloaded: drop time instead of bursting
KV_RESERVE_NEW_TOKEN_RATIO = 0.5  # share of max_new_tokens reserved at admission
KV_RESERVE_NEW_TOKEN_CAP = 4096


class QueueFull(Exception):
    """The waiting queue is at --max-queued-requests; SGLang answers 503."""


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    stop_at: int  # output length at which the model would emit EOS (== max_new when ignore_eos)
    words: WordStream
    arrival_real: float
    state: str = "waiting"  # waiting | prefill | running | done
    prefilled: int = 0
    generated: int = 0
    finish_reason: str | None = None
    first_token_real: float | None = None
    last_token_real: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kv_reserve(self) -> int:
        new = min(self.max_new_tokens, KV_RESERVE_NEW_TOKEN_CAP) * KV_RESERVE_NEW_TOKEN_RATIO
        return self.prompt_tokens + math.ceil(new)

    @property
    def done(self) -> bool:
        return self.state == "done"


@dataclass
class Snapshot:
    """Values SGLang publishes periodically rather than live (gauges, /v1/loads)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    gen_throughput: float = 0.0
    accept_length: float = 0.0
    at_sim: float = 0.0


@dataclass
class Counters:
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    abort_times: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    busy_sim_s: float = 0.0
    dropped_real_s: float = 0.0
    max_late_real_s: float = 0.0


class Engine:
    def __init__(self, name: str, kind: str, profile: Profile, gpu: SharedGpu, seed: int,
                 limits: EngineDefaults, max_queued_requests: int | None = None) -> None:
        self.name = name
        self.kind = kind  # "eagle" | "baseline"
        self.is_eagle = kind == "eagle"
        self.profile = profile
        self.gpu = gpu
        self.clock = gpu.clock
        self.limits = limits
        self.max_queued_requests = max_queued_requests
        self.rng = self._sampler(seed)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.counters = Counters()
        self.loads = Snapshot()
        self.gauges = Snapshot()
        self._accept_window: deque[tuple[int, int]] = deque(maxlen=ACCEPT_WINDOW_STEPS)
        self._accept_override: float | None = None
        self._schedule: tuple[tuple[float, float], ...] = profile.accept_length_schedule
        self._schedule_t0 = 0.0
        self._accept_model = physics.AcceptModel.for_mean(
            profile.accept_length, physics.max_accept(profile))
        self._wake = asyncio.Event()
        self._rid_rng = random.Random(f"rid:{seed}:{name}")
        self._task: asyncio.Task[None] | None = None
        self._tokens_since_snapshot = 0
        self._last_snapshot_sim = 0.0
        self._decode_since_loads = 0
        self._decode_since_metrics = 0
        self.started_at = time.time()

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- requests ------------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"{self._rid_rng.getrandbits(128):032x}"

    def submit(self, req: SimRequest) -> None:
        if self.max_queued_requests is not None and len(self.waiting) >= self.max_queued_requests:
            raise QueueFull()
        self.counters.requests += 1
        self.counters.prompt_tokens += req.prompt_tokens
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Client went away: free the slot and the KV space now, not at the next step."""
        if req.done:
            return
        if req.state == "waiting":
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        elif req.state == "prefill":
            self.prefilling.remove(req)
        else:
            self.running.remove(req)
        req.state = "done"
        req.finish_reason = "abort"
        self.counters.aborted += 1
        self.counters.abort_times.append(time.monotonic())
        req.event.set()
        self._wake.set()

    def finish_early(self, req: SimRequest, reason: str) -> None:
        """A stop string matched in the text: the request ends like an EOS."""
        if req.done:
            return
        if req in self.running:
            self.running.remove(req)
        req.state = "done"
        req.finish_reason = reason
        self.counters.finished += 1
        req.event.set()

    # --- accept length -------------------------------------------------------------------
    def set_accept_length(self, value: float) -> None:
        self._accept_override = value
        self._schedule = ()

    def _sampler(self, seed: int) -> random.Random:
        return random.Random(f"{seed}:{self.name}:{self.kind}")

    def reseed(self, seed: int) -> None:
        """Restart the acceptance and output-length draws from `seed`: a benchmark that
        reseeds before each run gives every config the same random draws (common random
        numbers), so the configs differ by what they do and not by their luck."""
        self.rng = self._sampler(seed)

    def set_accept_schedule(self, schedule: tuple[tuple[float, float], ...]) -> None:
        self._accept_override = None
        self._schedule = schedule
        self._schedule_t0 = self.clock.sim_now()

    def accept_length(self) -> float:
        """The mean accept length the sampler uses now (override, schedule or profile)."""
        if self._accept_override is not None:
            return self._accept_override
        value = self.profile.accept_length
        elapsed = self.clock.sim_now() - self._schedule_t0
        for t, v in self._schedule:
            if elapsed >= t:
                value = v
        return value

    def observed_accept_length(self) -> float:
        tokens = sum(t for t, _ in self._accept_window)
        reqs = sum(n for _, n in self._accept_window)
        return tokens / reqs if reqs else 0.0

    # --- live load -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def used_tokens(self) -> int:
        active = itertools.chain(self.running, self.prefilling)
        return sum(r.prefilled + r.generated for r in active)

    def _reserved_tokens(self) -> int:
        return sum(r.kv_reserve for r in itertools.chain(self.running, self.prefilling))

    # --- the step loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        prev_end = self.clock.real()
        while True:
            if not (self.waiting or self.prefilling or self.running):
                self._publish(force=True)
                self._wake.clear()
                await self._wake.wait()
                earliest = self.clock.real()
            else:
                now = self.clock.real()
                earliest = max(prev_end, now - MAX_CATCH_UP_REAL_S)
                if prev_end < earliest:
                    self.counters.dropped_real_s += earliest - prev_end
            self._admit()
            if self.prefilling:
                chunk, sim_ms = self._plan_prefill()
                _, end = self.gpu.reserve(earliest, sim_ms)
                await self._sleep_until(end)
                self._apply_prefill(chunk, end)
                self.counters.prefill_steps += 1
                self.loads = self._snapshot()  # SGLang publishes on every prefill batch
            elif self.running:
                batch = list(self.running)
                ctx = sum(r.prompt_tokens + r.generated for r in batch) / len(batch)
                step = physics.eagle_step_ms if self.is_eagle else physics.decode_step_ms
                sim_ms = step(self.profile, len(batch), ctx)
                _, end = self.gpu.reserve(earliest, sim_ms)
                await self._sleep_until(end)
                self._apply_decode(batch, end)
            else:
                continue  # everything waiting was aborted or cannot fit yet
            self.counters.busy_sim_s += sim_ms / 1000.0
            prev_end = end

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - self.clock.real()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            self.counters.max_late_real_s = max(self.counters.max_late_real_s, -delay)

    def _admit(self) -> None:
        reserved = self._reserved_tokens()
        while self.waiting and self.num_running < self.limits.max_running_requests:
            req = self.waiting[0]
            if reserved + req.kv_reserve > self.limits.kv_capacity_tokens and self.num_running:
                break  # wait for KV space; an empty engine admits even an oversized request
            self.waiting.popleft()
            req.state = "prefill"
            self.prefilling.append(req)
            reserved += req.kv_reserve
            self.counters.admitted += 1

    def _plan_prefill(self) -> tuple[list[tuple[SimRequest, int]], float]:
        budget = self.profile.chunked_prefill_size
        chunk: list[tuple[SimRequest, int]] = []
        tokens = 0
        for req in self.prefilling:
            take = min(req.prompt_tokens - req.prefilled, budget - tokens)
            if take <= 0:
                break
            chunk.append((req, take))
            tokens += take
        return chunk, physics.prefill_ms(self.profile, tokens, self.is_eagle)

    def _apply_prefill(self, chunk: list[tuple[SimRequest, int]], end: float) -> None:
        for req, take in chunk:
            if req.done:
                continue
            req.prefilled += take
            if req.prefilled >= req.prompt_tokens:
                self.prefilling.remove(req)
                req.state = "running"
                self.running.append(req)
                self._emit(req, 1, end)  # prefill yields the first token

    def _apply_decode(self, batch: list[SimRequest], end: float) -> None:
        model = self._current_accept_model() if self.is_eagle else None
        step_tokens = 0
        live = 0
        for req in batch:
            if req.done:
                continue
            n = model.sample(self.rng) if model is not None else 1
            step_tokens += n
            live += 1
            self._emit(req, n, end)
        self.counters.decode_steps += 1
        if self.is_eagle and live:
            self._accept_window.append((step_tokens, live))
        self._decode_since_loads += 1
        self._decode_since_metrics += 1
        self._publish(force=False)

    def _current_accept_model(self) -> physics.AcceptModel:
        mean = self.accept_length()
        if mean != self._accept_model.mean:
            limit = physics.max_accept(self.profile)
            self._accept_model = physics.AcceptModel.for_mean(mean, limit)
        return self._accept_model

    def _emit(self, req: SimRequest, n: int, end: float) -> None:
        n = min(n, req.stop_at - req.generated)
        req.generated += n
        self.counters.generated_tokens += n
        self._tokens_since_snapshot += n
        if req.first_token_real is None:
            req.first_token_real = end
        req.last_token_real = end
        if req.generated >= req.stop_at:
            self.running.remove(req)
            req.state = "done"
            req.finish_reason = "length" if req.generated >= req.max_new_tokens else "stop"
            self.counters.finished += 1
        req.event.set()

    def _publish(self, force: bool) -> None:
        if force or self._decode_since_loads >= LOADS_PUBLISH_STEPS:
            self._decode_since_loads = 0
            self.loads = self._snapshot()
        if force or self._decode_since_metrics >= METRICS_LOG_STEPS:
            self._decode_since_metrics = 0
            self.gauges = self._snapshot()
            self._tokens_since_snapshot = 0
            self._last_snapshot_sim = self.gauges.at_sim

    def _snapshot(self) -> Snapshot:
        now = self.clock.sim_now()
        elapsed = now - self._last_snapshot_sim
        throughput = self._tokens_since_snapshot / elapsed if elapsed > 0 else 0.0
        return Snapshot(self.num_running, len(self.waiting), self.used_tokens(), throughput,
                        self.observed_accept_length(), now)
