"""One simulated SGLang engine: a continuous-batching scheduler stepping on a shared GPU.

The scheduler follows SGLang's shape: new requests wait in a queue, are admitted while a batch
slot (`max_running_requests`) and KV space are free, are prefilled in chunks (prefill has
priority over decode, as in SGLang's default policy), then decode one step at a time; an EAGLE
engine's decode step is draft steps plus one verify step and yields a random number of tokens
per request. Token delivery is an asyncio.Event per request, so HTTP handlers stream each
step's tokens as one chunk, as SGLang does.

Steps are booked at absolute deadlines on the SharedGpu; a late event loop makes the next
sleep shorter rather than pushing every later step back, so the simulated clock keeps pace.
A request's prefill never starts before the request arrived, so a catch-up never serves a
request faster than the GPU could have: its TTFT and end-to-end latency stay at or above
the physical minimum, as a probe or a benchmark reading them assumes.
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
from specrouter.sim.adaptive import AdaptiveSteps
from specrouter.sim.gpu import SharedGpu
from specrouter.sim.prefix import Blocks
from specrouter.sim.profile import EngineDefaults, Profile
from specrouter.sim.radix import Node, RadixCache
from specrouter.sim.text import WordStream

LOADS_PUBLISH_STEPS = 15  # SGLang --load-snapshot-publish-interval default
METRICS_LOG_STEPS = 40  # SGLang --decode-log-interval default: gauges and accept folds
ACCEPT_WINDOW_STEPS = 40  # /sim/state observed_accept_length: a sliding window (sim only)
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
    priority: int | None = None
    counted: bool = True  # False for /health's request (SGLang: log_metrics=False)
    verify_steps: int = 0  # EAGLE verify steps this request took part in
    correct_drafts: int = 0  # draft tokens accepted (the bonus token is not a draft)
    proposed_drafts: int = 0  # draft tokens proposed (steps per verify; adaptive: varies)
    blocks: Blocks | None = None  # the prompt's prefix keys; None: never cached (/health)
    cached: int = 0  # prompt tokens found in the prefix cache at admission
    cache_node: Node | None = None  # the cached prefix this request holds locked
    in_tree: bool = False  # the whole prompt is in the prefix cache (prefill done)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kv_reserve(self) -> int:
        """KV tokens this request holds outside the prefix cache, reserved at admission: its
        uncached prompt until prefill puts the prompt in the cache, plus the output share."""
        new = min(self.max_new_tokens, KV_RESERVE_NEW_TOKEN_CAP) * KV_RESERVE_NEW_TOKEN_RATIO
        prompt = 0 if self.in_tree else self.prompt_tokens - self.cached
        return prompt + math.ceil(new)

    @property
    def prefill_started(self) -> bool:
        """A prefill chunk has run for it (the cached prefix needs none)."""
        return self.prefilled > self.cached

    @property
    def private_used(self) -> int:
        """KV tokens in use outside the prefix cache: computed uncached prompt and output."""
        return (0 if self.in_tree else self.prefilled - self.cached) + self.generated

    @property
    def done(self) -> bool:
        return self.state == "done"


@dataclass
class Snapshot:
    """The scheduler's load as SGLang reports it (gauges, /v1/loads).

    Counts follow SGLang's queues: `num_running_reqs` is the running batch, `num_waiting_reqs`
    the waiting queue; a request part-way through a chunked prefill is in neither
    (load_inquirer.py:112)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_waiting_tokens: int = 0  # prompt tokens still to prefill, queued or chunked
    # 0.5.23's estimate under FCFS: a waiting prompt x the recent miss rate, plus the
    # chunked request's remainder (load_inquirer.py:82-105)
    num_waiting_uncached_tokens: int = 0
    gen_throughput: float = 0.0
    accept_length: float = 0.0  # lifetime mean (0.0 before the first fold)
    window_accept_length: float = 0.0  # mean over the last folded 40 decode batches
    window_accept_rate: float = 0.0
    running_by_priority: dict[str, int] = field(default_factory=dict)
    waiting_by_priority: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_busy_us: int = 0
    cache_hit_rate: float = 0.0  # cached / (cached + computed) tokens of the last prefill batch
    at_sim: float = 0.0
    timestamp: float = 0.0  # time.time() when built: the server clock


class HitRateWindow:
    """SGLang's _CacheHitRateWindow (metrics_reporter.py 0.5.23:79-97): hit tokens over
    prefilled tokens of the prefill batches of the last 15 s (SGLANG_CACHE_HIT_RATE_WINDOW_
    SECONDS), which prices the waiting queue's uncached tokens. Simulated seconds here."""

    WINDOW_S = 15.0

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int]] = deque()
        self.hit = 0
        self.total = 0

    def add(self, hit: int, total: int, now: float) -> None:
        if total > 0:
            self.samples.append((now, hit, total))
            self.hit += hit
            self.total += total
        while self.samples and self.samples[0][0] <= now - self.WINDOW_S:
            _, h, t = self.samples.popleft()
            self.hit -= h
            self.total -= t

    def rate(self) -> float:
        return self.hit / self.total if self.total else 0.0


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
    prefill_tokens: int = 0  # prompt tokens computed by prefill (the uncached ones)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prefill_busy_sim_s: float = 0.0
    dropped_real_s: float = 0.0
    max_late_real_s: float = 0.0


@dataclass
class SpecCounters:
    """SGLang's speculative counters (metrics_reporter.py:292-299, 953-1002): a window summed
    over decode batches and folded into lifetime totals every decode_log_interval batches."""

    window_accept_tokens: int = 0
    window_forward_ct: int = 0  # requests x verify steps
    total_accept_tokens: int = 0
    total_forward_ct: int = 0

    def lifetime_mean(self) -> float:
        return self.total_accept_tokens / self.total_forward_ct if self.total_forward_ct else 0.0

    def fold(self) -> float:
        """Close the window; returns its mean accept length."""
        mean = (self.window_accept_tokens / self.window_forward_ct
                if self.window_forward_ct else 0.0)
        self.total_accept_tokens += self.window_accept_tokens
        self.total_forward_ct += self.window_forward_ct
        self.window_accept_tokens = self.window_forward_ct = 0
        return mean


class Engine:
    def __init__(self, name: str, kind: str, profile: Profile, gpu: SharedGpu, seed: int,
                 limits: EngineDefaults, max_queued_requests: int | None = None) -> None:
        self.name = name
        self.kind = kind  # "eagle" | "baseline" | "adaptive"
        # an adaptive engine is an EAGLE-3 server whose draft steps follow the batch size
        self.is_eagle = kind in ("eagle", "adaptive")
        self.adaptive = (AdaptiveSteps(limits.max_running_requests, profile.draft.steps)
                         if kind == "adaptive" else None)
        self.profile = profile
        self.gpu = gpu
        self.clock = gpu.clock
        self.limits = limits
        self.max_queued_requests = max_queued_requests
        self.rng = self._sampler(seed)
        self.cache = RadixCache()
        self.cache_hit_rate = 0.0  # of the last prefill batch (SGLang's per-report value)
        self._hit_window = HitRateWindow()
        # 0.5.10's decode log writes a 0.0 cache_hit_rate; 0.5.23's keeps the prefill value
        self.decode_log_clears_hit_rate = False
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.counters = Counters()
        self.spec = SpecCounters()
        self.by_rid: dict[str, SimRequest] = {}
        self.loads = Snapshot()
        self.gauges = Snapshot()
        self.steps_done = 0  # any step since a /health call answers it
        self._unwedged = asyncio.Event()
        self._unwedged.set()
        self.publishes = 0  # /v1/loads snapshots published (0.5.23 freshness tests)
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
        if req.counted:
            self.counters.requests += 1
            self.counters.prompt_tokens += req.prompt_tokens
        self.by_rid[req.rid] = req
        self.waiting.append(req)
        self._wake.set()

    def abort_rid(self, rid: str) -> bool:
        """POST /abort_request: abort the request with this rid now, if it is in flight."""
        req = self.by_rid.get(rid)
        if req is None:
            return False
        self.abort(req)
        return True

    def abort_all(self) -> None:
        for req in list(self.by_rid.values()):
            self.abort(req)

    def flush_cache(self) -> bool:
        """/flush_cache: an idle scheduler empties its prefix cache and resets its metrics,
        speculative counters included; a busy one does nothing and says so (scheduler.py
        0.5.23:5518-5547, metrics_reporter.py:709-715)."""
        if not self.idle:
            return False
        self.cache = RadixCache()
        self.cache_hit_rate = 0.0
        self._hit_window = HitRateWindow()
        self.spec = SpecCounters()
        return True

    # --- the wedged-scheduler fault --------------------------------------------------------
    @property
    def wedged(self) -> bool:
        return not self._unwedged.is_set()

    def set_wedged(self, wedged: bool) -> None:
        """A wedged scheduler runs no step: requests in flight make no progress, nothing is
        published, and /health sees no output."""
        if wedged:
            self._unwedged.clear()
        else:
            self._unwedged.set()

    def health_check(self) -> None:
        """/health's 1-token request. A busy scheduler skips it and acks after its current
        batch (scheduler.py:2240-2247): any step end counts. An idle one runs it."""
        if self.waiting or self.prefilling or self.running:
            return
        rng = random.Random(f"health:{self.name}")
        self.submit(SimRequest(f"HEALTH_CHECK_{self.new_rid()}", 1, 1, 1, WordStream(rng),
                               self.clock.real(), counted=False))

    def abort(self, req: SimRequest) -> None:
        """The abort reaches the scheduler: free the slot and the KV space now."""
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
        self._release(req)
        self.by_rid.pop(req.rid, None)
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
        self._release(req)
        self.by_rid.pop(req.rid, None)
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

    def lifetime_accept_length(self) -> float:
        """What /v1/loads and /server_info report: accepted tokens over verify steps since
        start (or the last /flush_cache), as of the last fold."""
        return self.spec.lifetime_mean()

    def observed_accept_length(self) -> float:
        tokens = sum(t for t, _ in self._accept_window)
        reqs = sum(n for _, n in self._accept_window)
        return tokens / reqs if reqs else 0.0

    # --- live load -------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    def refresh_idle_snapshot(self) -> None:
        """0.5.23's idle scheduler loops without a batch and publishes a snapshot on every
        iteration (scheduler.py:5241-5324, no --sleep-on-idle): an idle engine's snapshot is
        always fresh. A wedged scheduler loops no more."""
        if self.idle and not self.wedged:
            self.publish_loads()

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def num_waiting_as_sglang(self) -> int:
        """SGLang's waiting queue: queued here, or admitted but not yet touched by prefill."""
        return len(self.waiting) + sum(1 for r in self.prefilling if not r.prefill_started)

    def used_tokens(self) -> int:
        """SGLang's num_used_tokens: the pool minus free and evictable tokens, i.e. the
        locked prefixes plus what running requests hold outside the cache."""
        active = itertools.chain(self.running, self.prefilling)
        return self.cache.protected_tokens + sum(r.private_used for r in active)

    # --- the prefix cache ------------------------------------------------------------------
    def _release(self, req: SimRequest) -> None:
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None

    def cache_output(self, req: SimRequest, text: str) -> None:
        """A finished request's answer joins its prompt in the cache (SGLang's
        cache_finished_req keeps prompt and output KV in the tree), spelled as the next turn
        of the same conversation spells it. The handler calls this with the final text."""
        if req.blocks is None or not req.in_tree or req.finish_reason == "abort" or not text:
            return
        chain = req.blocks.with_output(text)
        self.cache.insert(chain.keys, chain.tokens, self.clock.sim_now())
        self._fit_cache()

    def _fit_cache(self) -> None:
        over = (self.cache.total_tokens + self._reserved_tokens()
                - self.limits.kv_capacity_tokens)
        if over > 0:
            self.cache.evict(over)

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
            if self.wedged:
                await self._unwedged.wait()
                earliest = prev_end = self.clock.real()
            self._admit()
            if self.prefilling:
                chunk, sim_ms = self._plan_prefill()
                # a catch-up books steps in the past, but none before its requests arrived
                arrived = max((req.arrival_real for req, _ in chunk), default=earliest)
                _, end = self.gpu.reserve(max(earliest, arrived), sim_ms)
                await self._sleep_until(end)
                self._apply_prefill(chunk, end)
                self.counters.prefill_steps += 1
                self.counters.prefill_tokens += sum(take for _, take in chunk)
                self.counters.prefill_busy_sim_s += sim_ms / 1000.0
                self.gauges = self._snapshot(self.gauges)  # every prefill batch refreshes
                self.publish_loads()  # both the gauges and the load snapshot
            elif self.running:
                batch = list(self.running)
                ctx = sum(r.prompt_tokens + r.generated for r in batch) / len(batch)
                steps = self.profile.draft.steps
                if self.adaptive is not None:
                    steps = self.adaptive.steps_for_batch(len(batch))
                    sim_ms = physics.adaptive_step_ms(self.profile, len(batch), ctx, steps)
                else:
                    step = physics.eagle_step_ms if self.is_eagle else physics.decode_step_ms
                    sim_ms = step(self.profile, len(batch), ctx)
                _, end = self.gpu.reserve(earliest, sim_ms)
                await self._sleep_until(end)
                self._apply_decode(batch, end, steps)
            else:
                continue  # everything waiting was aborted or cannot fit yet
            self.counters.busy_sim_s += sim_ms / 1000.0
            self.steps_done += 1
            prev_end = end

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - self.clock.real()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            self.counters.max_late_real_s = max(self.counters.max_late_real_s, -delay)

    def _admit(self) -> None:
        """FCFS admission while a batch slot and KV space are free. The head request's prompt
        is matched against the prefix cache (at most all but its last token, as SGLang's
        _compute_max_prefix_len, schedule_batch.py:1766-1785) and the match is locked; KV
        space is what neither the cache nor running requests hold, plus what evicting
        unlocked prefixes frees."""
        if not self.waiting:
            return
        cache, cap = self.cache, self.limits.kv_capacity_tokens
        reserved = self._reserved_tokens()
        while self.waiting and self.num_running < self.limits.max_running_requests:
            req = self.waiting[0]
            node: Node | None = None
            req.cached = 0
            if req.blocks is not None:
                node, m = cache.match(req.blocks.keys, self.clock.sim_now())
                req.cached = max(0, min(sum(req.blocks.tokens[:m]), req.prompt_tokens - 1))
                cache.lock(node)
            need = req.kv_reserve
            free = cap - cache.total_tokens - reserved
            if need > free:
                free += cache.evict(need - free)
            if need > free and self.num_running:
                if node is not None:
                    cache.unlock(node)
                req.cached = 0
                break  # wait for KV space; an empty engine admits even an oversized request
            self.waiting.popleft()
            req.state = "prefill"
            req.cache_node = node
            req.prefilled = req.cached
            self.prefilling.append(req)
            reserved += need
            if req.counted:
                self.counters.admitted += 1
                self.counters.cached_tokens += req.cached

    def _plan_prefill(self) -> tuple[list[tuple[SimRequest, int]], float]:
        budget = self.profile.chunked_prefill_size
        chunk: list[tuple[SimRequest, int]] = []
        tokens = hits = 0
        for req in self.prefilling:
            take = min(req.prompt_tokens - req.prefilled, budget - tokens)
            if take <= 0:
                break
            if req.prefilled == req.cached:  # its first chunk: its cache hit counts here
                hits += req.cached
            chunk.append((req, take))
            tokens += take
        self.cache_hit_rate = hits / (hits + tokens) if hits + tokens else 0.0
        self._hit_window.add(hits, hits + tokens, self.clock.sim_now())
        return chunk, physics.prefill_ms(self.profile, tokens, self.is_eagle)

    def _apply_prefill(self, chunk: list[tuple[SimRequest, int]], end: float) -> None:
        for req, take in chunk:
            if req.done:
                continue
            req.prefilled += take
            if req.prefilled >= req.prompt_tokens:
                self._prompt_to_cache(req)
                self.prefilling.remove(req)
                req.state = "running"
                self.running.append(req)
                self._emit(req, 1, end)  # prefill yields the first token

    def _prompt_to_cache(self, req: SimRequest) -> None:
        """Prefill done: the prompt's KV moves into the cache, locked by this request until
        it ends (SGLang's cache_unfinished_req), so concurrent requests with the same prefix
        hit it from now on."""
        if req.blocks is None:
            return
        node, _ = self.cache.insert(req.blocks.keys, req.blocks.tokens, self.clock.sim_now())
        self.cache.lock(node)
        self._release(req)
        req.cache_node = node
        req.in_tree = True
        self._fit_cache()

    def _apply_decode(self, batch: list[SimRequest], end: float, steps: int) -> None:
        model = self._current_accept_model() if self.is_eagle else None
        if model is not None and self.adaptive is not None:
            model = model.with_max_len(steps + 1)  # the same p over this step's chain
        step_tokens = 0
        live = 0
        correct: list[int] = []
        proposed = steps if self.adaptive is not None else self.profile.draft.num_draft_tokens - 1
        for req in batch:
            if req.done:
                continue
            n = model.sample(self.rng) if model is not None else 1
            step_tokens += n
            live += 1
            req.verify_steps += 1
            req.correct_drafts += n - 1
            req.proposed_drafts += proposed
            correct.append(n - 1)
            self._emit(req, n, end)
        if self.adaptive is not None:
            self.adaptive.on_verify(correct, len(batch))
        self.counters.decode_steps += 1
        if self.is_eagle and live:
            self._accept_window.append((step_tokens, live))
            self.spec.window_accept_tokens += step_tokens
            self.spec.window_forward_ct += live
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
        if req.counted:
            self.counters.generated_tokens += n
        self._tokens_since_snapshot += n
        if req.first_token_real is None:
            req.first_token_real = end
        req.last_token_real = end
        if req.generated >= req.stop_at:
            self.running.remove(req)
            req.state = "done"
            req.finish_reason = "length" if req.generated >= req.max_new_tokens else "stop"
            self._release(req)
            self.by_rid.pop(req.rid, None)
            if req.counted:
                self.counters.finished += 1
        req.event.set()

    def _publish(self, force: bool) -> None:
        """Gauges refresh at every 40th decode batch (with the accept fold) and at idle; the
        load snapshot at every 15th decode batch, every prefill batch and at idle."""
        if self._decode_since_metrics >= METRICS_LOG_STEPS:
            self._decode_since_metrics = 0
            self._log_decode_stats()
        elif force:
            self.gauges = self._snapshot(self.gauges)
        if force or self._decode_since_loads >= LOADS_PUBLISH_STEPS:
            self._decode_since_loads = 0
            self.publish_loads()

    def publish_loads(self) -> None:
        self.loads = self.live_snapshot()
        self.publishes += 1

    def _log_decode_stats(self) -> None:
        """SGLang's decode log: fold the speculative window, refresh every gauge."""
        now = self.clock.sim_now()
        elapsed = now - self._last_snapshot_sim
        stats = Snapshot(gen_throughput=self._tokens_since_snapshot / elapsed
                         if elapsed > 0 else 0.0)
        if self.is_eagle:
            drafts = self.profile.draft.num_draft_tokens - 1
            forward = self.spec.window_forward_ct
            accepted = self.spec.window_accept_tokens
            stats.window_accept_rate = ((accepted - forward) / (forward * drafts)
                                        if forward and drafts > 0 else 0.0)
            stats.window_accept_length = self.spec.fold()
        self._tokens_since_snapshot = 0
        self._last_snapshot_sim = now
        if self.decode_log_clears_hit_rate:
            self.cache_hit_rate = 0.0
        self.gauges = self._snapshot(stats)

    def live_snapshot(self) -> Snapshot:
        """The load now, with the stats (throughput, windowed accept) of the last decode log."""
        return self._snapshot(self.gauges)

    def _snapshot(self, stats: Snapshot) -> Snapshot:
        waiting = [*self.waiting, *(r for r in self.prefilling if not r.prefill_started)]
        chunked = [r for r in self.prefilling if r.prefill_started]
        miss = 1.0 - self._hit_window.rate()
        return Snapshot(
            num_running_reqs=len(self.running), num_waiting_reqs=len(waiting),
            num_used_tokens=self.used_tokens(),
            num_waiting_tokens=sum(r.prompt_tokens - r.prefilled for r in (*waiting, *chunked)),
            num_waiting_uncached_tokens=(sum(int(r.prompt_tokens * miss) for r in waiting)
                                         + sum(r.prompt_tokens - r.prefilled for r in chunked)),
            gen_throughput=stats.gen_throughput, accept_length=self.lifetime_accept_length(),
            window_accept_length=stats.window_accept_length,
            window_accept_rate=stats.window_accept_rate,
            running_by_priority=_by_priority(self.running),
            waiting_by_priority=_by_priority(waiting),
            prefill_tokens=self.counters.prefill_tokens,
            prefill_busy_us=round(self.counters.prefill_busy_sim_s * 1e6),
            cache_hit_rate=self.cache_hit_rate,
            at_sim=self.clock.sim_now(), timestamp=time.time())


def _by_priority(reqs: list[SimRequest]) -> dict[str, int]:
    """SGLang's QueueCount.by_priority: a request without a priority counts under "None"."""
    counts: dict[str, int] = {}
    for req in reqs:
        key = str(req.priority)
        counts[key] = counts.get(key, 0) + 1
    return counts
