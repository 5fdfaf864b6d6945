"""Shadow probes: re-measure an idle EAGLE-3 server's accept length without a client's
request; cost probes: measure a pool's decode step before the online model prices it.

While the goodput strategy holds a group on the baseline, its EAGLE server decodes
nothing, so the accept length the router knows would stay frozen and a workload whose
accept length rose again would never win EAGLE-3 back. When the policy asks for a probe
(`Target.probe`), the proxy sends a copy of the request it is routing, cut to a few
output tokens and not streamed, to the EAGLE server and drops the answer. A copy, not a
fixed prompt, because the accept length is a property of the live workload; the client's
own request still goes where the policy chose.

A probe counts as in flight on its server while it runs and its outcome feeds passive
health like any exchange.

`CostProber` measures the step cost of a pool the online cost model has no reading of
(`routing/costprobe.py`): at start-up and whenever the pool still has none, once its whole
group is idle. A request for the group (from any replica: the in-flight counts are the
cluster's) cancels the probe, so a probe never shares the GPU with a client's request for
longer than the check interval; a replica never starts one while any server of the group
is busy, which includes another replica's probe.

Replicas share probes through the state store. A probe runs only under its group's
cluster-wide lock (`StateStore.try_lock`), so replicas starting together put one probe at
a time on a group's GPUs (both pools' servers share them) and not one each, which would
read a step at a batch of N; the lock lives `timeout_s` plus a few seconds, the longest a
probe can take, so a replica that dies mid-probe frees it by itself. Every reading is
published, and each replica folds in the others' (each once, weighted by its age), so one
probe per pool per half-life serves the whole cluster. The lock's holder reads the
published readings first and skips a pool another replica has just read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from specrouter.backends import Backend, Pool
from specrouter.config import CostProbeSettings
from specrouter.errors import JSON_HEADERS
from specrouter.observe.loadview import GroupView
from specrouter.proxy.abort import send_abort
from specrouter.proxy.upstream import RawHeaders, RequestBody, Upstream, UpstreamError
from specrouter.routing.costprobe import (
    PROBE_PATH,
    PROBE_WEIGHT,
    SUFFIX_TOKENS,
    ProbeAnswer,
    context_due,
    cost_probe_body,
    due,
    parse_answer,
    probe_context,
    probe_prefix,
    step_reading,
)
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.router import Router, Target
from specrouter.state import ProbeReading, StateError, StateStore
from specrouter.tasks import cancel_and_wait

log = logging.getLogger("specrouter.proxy.shadow")

# Fields that would make the probe stream, sample several answers or return extras it
# does not need (the server's defaults are the cheap ones), and the client's `rid`, which
# names the client's own request.
_DROPPED = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs",
            "echo", "return_logprob", "return_hidden_states", "rid")


def probe_body(path: str, body: RequestBody, max_tokens: int) -> bytes | None:
    """The shadow copy of a generation request, or None when the body is not a JSON
    object (the proxy already answered such a request with 400)."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for key in _DROPPED:
        data.pop(key, None)
    if path.startswith("/generate"):
        params = data.get("sampling_params")
        params = dict(params) if isinstance(params, dict) else {}
        params["max_new_tokens"] = _cut(params.get("max_new_tokens"), max_tokens)
        data["sampling_params"] = params
    else:
        data["max_tokens"] = _cut(data.get("max_tokens", data.get("max_completion_tokens")),
                                  max_tokens)
        data.pop("max_completion_tokens", None)
    return json.dumps(data, separators=(",", ":")).encode()


def _cut(asked: Any, limit: int) -> int:
    return min(asked, limit) if isinstance(asked, int) and asked > 0 else limit


class ShadowProber:
    """Sends probes in the background; `aclose` cancels the ones still running."""

    def __init__(self, router: Router, upstreams: Mapping[str, Upstream],
                 timeout_s: float) -> None:
        self._router = router
        self._upstreams = upstreams
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, target: Target, path: str, headers: RawHeaders, body: bytes) -> None:
        """Start one probe to `target` (the EAGLE server) with this already-shadowed body."""
        task = asyncio.get_running_loop().create_task(self._run(target, path, headers, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, target: Target, path: str, headers: RawHeaders, body: bytes) -> None:
        name = target.backend.name
        self._router.acquire(target)
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._upstreams[name].open("POST", path, headers, body,
                                                            stream=False)
                try:
                    async for _ in response.iter_raw():
                        pass
                finally:
                    await response.aclose()
            ok = response.status < 500
            self._router.record_outcome(name, ok, None if ok else f"HTTP {response.status}")
        except (UpstreamError, TimeoutError) as exc:
            log.info("probe of %s failed: %s", name, exc or "timed out")
            self._router.record_outcome(name, False, f"probe: {exc or 'timed out'}")
        finally:
            self._router.release(target)

    async def aclose(self) -> None:
        await cancel_and_wait(list(self._tasks))


class ProbeHost(Router, Protocol):
    """A router whose monitor holds the online cost models (`LoadAwareRouter`)."""

    monitor: BackendMonitor


#: The rid of every cost-probe generation starts with this.
PROBE_RID_PREFIX = "specrouter-cost-probe-"
#: The order pools are probed in: the baseline's cost is the one a move trusts.
POOLS: tuple[Pool, ...] = ("baseline", "eagle")
#: Seconds between two looks at the group's in-flight count while a probe runs.
_WATCH_S = 0.005
#: Seconds a probe between two rounds waits for a group busy only by its engines' own
#: reports to go idle (`_settled_backend`).
_SETTLE_S = 1.0
#: Seconds before a pool whose probe failed (no answer a step could be read from) is
#: probed again.
_FAILED_RETRY_S = 60.0
#: Seconds the aborts of a cancelled or timed-out probe's generations may take.
_ABORT_S = 2.0
#: Seconds a probe's lock outlives the probe's own limit (`timeout_s` and its aborts).
_LOCK_SLACK_S = 2.0
#: A shared reading weighing less than this after its age's decay is not folded in.
_MIN_SHARED_WEIGHT = 0.01

#: How a probe attempt ended: a reading of every batch; the group was busy; another
#: replica holds the group's lock; a reading another replica published made it unneeded;
#: a request for the group cancelled it; no step could be read (or it ran out of time).
Outcome = Literal["read", "busy", "locked", "shared", "cancelled", "failed"]


def lock_ttl_s(settings: CostProbeSettings) -> float:
    """Life of a probe's lock: the probe's own limit, its aborts, and a margin."""
    return settings.timeout_s + _ABORT_S + _LOCK_SLACK_S


def lock_name(group: str) -> str:
    return f"cost-probe:{group}"


class _Cancelled(Exception):
    """A request for the group arrived while a probe ran."""


def probe_targets(group: str, pool: Pool, backend: Backend, batch: int,
                  prefill_tokens: int) -> list[Target]:
    """The targets of one probe round, as the router counts them in flight: each with the
    prompt tokens it prefills, which the cost model's readings of the round's telemetry
    windows are taken net of (routing/learning.py)."""
    return [Target(group, pool, backend, "cost_probe", prefill_tokens=float(prefill_tokens),
                   own=True)
            for _ in range(batch)]


class CostProber:
    """Probes each group's unread pools in the background (`start`, `aclose`)."""

    def __init__(self, router: ProbeHost, upstreams: Mapping[str, Upstream],
                 settings: CostProbeSettings) -> None:
        self._router = router
        self._monitor = router.monitor
        self._upstreams = upstreams
        self._settings = settings
        cluster = self._monitor.cluster
        self._store: StateStore | None = None if cluster is None else cluster.state.store
        self._task: asyncio.Task[None] | None = None
        self._not_before: dict[tuple[str, Pool], float] = {}
        # the (group, pool) pairs with a server: a pool without one is never due
        self._served = {(b.group, b.pool) for b in router.backends}

    @classmethod
    def of(cls, router: Router, upstreams: Mapping[str, Upstream],
           settings: CostProbeSettings) -> CostProber | None:
        """A prober when probes are on and the router learns cost models."""
        if not settings.enabled or not isinstance(getattr(router, "monitor", None),
                                                  BackendMonitor):
            return None
        return cls(router, upstreams, settings)  # type: ignore[arg-type]

    async def start(self) -> None:
        """Probe every group's unread pools once its servers are healthy (at most
        `startup_wait_s`), then keep probing in the background."""
        if self._settings.startup_wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.startup_wait_s):
                    await asyncio.gather(*(self._first(g) for g in self._monitor.learning.groups))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _first(self, group: str) -> None:
        """Each due pool read once, by this replica or, while another replica holds the
        group's lock or its probe keeps the group busy, by that one."""
        while True:
            view = self._group(group)
            if all(b.healthy for b in view.backends):
                break
            await asyncio.sleep(_WATCH_S * 10)
        for pool in POOLS:
            while self._due(group, pool):
                if await self.probe(group, pool) not in ("locked", "busy"):
                    break
                await asyncio.sleep(_WATCH_S * 10)
                self._fold_taken()

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while True:
            self._fold_taken()
            for group in self._monitor.learning.groups:
                for pool in POOLS:
                    if self._due(group, pool):
                        await self.probe(group, pool)
            await asyncio.sleep(self._settings.check_s)

    def _due(self, group: str, pool: Pool) -> bool:
        """Whether `pool` of `group` wants a reading now. Never for a pool the group has
        no server of: nothing could read it, and the start-up would wait for it for all
        of `startup_wait_s` and the background loop try it every `check_s`."""
        if (group, pool) not in self._served:
            return False
        if self._monitor.clock() < self._not_before.get((group, pool), float("-inf")):
            return False
        learned = self._monitor.learning.model(group, self._monitor.clock()).pools[pool]
        traffic = self._monitor.learning.traffic_context(group)
        return due(learned.weight) or context_due(learned.probe_context, traffic,
                                                  learned.read_since_probe)

    def _group(self, group: str) -> GroupView:
        return next(g for g in self._monitor.groups(self._monitor.clock()) if g.name == group)

    def _idle_backend(self, group: str, pool: Pool) -> Backend | None:
        """`pool`'s healthy server in `group` when no server of the group is busy."""
        view = self._group(group)
        if any(b.load("max") > 0 for b in view.backends):
            return None
        servers = view.healthy_servers(pool)
        return None if not servers else next(
            b for b in self._router.backends if b.name == servers[0].name)

    async def _settled_backend(self, group: str, pool: Pool) -> Backend | None:
        """`_idle_backend` between two rounds of a probe. A group that holds none of the
        router's requests but whose engines report one running gets up to `_SETTLE_S` to
        go idle: such a report can be a request that is over within a telemetry poll
        (SGLang's `/health` runs a one-token generation on an idle engine, which
        `/v1/loads` counts before 0.5.23), and giving the probe up over it would waste the
        warm-up it has prefilled. A request of the router's gives it up at once."""
        deadline = self._monitor.clock() + _SETTLE_S
        while True:
            backend = self._idle_backend(group, pool)
            if (backend is not None or self._group_inflight(group) > 0
                    or self._monitor.clock() >= deadline):
                return backend
            await asyncio.sleep(_WATCH_S)

    def _group_inflight(self, group: str) -> int:
        return sum(b.inflight for b in self._group(group).backends)

    async def probe(self, group: str, pool: Pool) -> Outcome:
        """One probe of `pool` in `group` at each of its configured batches, under the
        group's cluster-wide lock (see `_lock`)."""
        if self._idle_backend(group, pool) is None:
            return "busy"
        granted, token = await self._lock(group)
        if not granted:
            self._monitor.learning.learner(group).note_probe(pool, "locked")
            return "locked"
        try:
            await self._fold_fresh()
            if not self._due(group, pool):
                return "shared"
            return await self._measure(group, pool)
        finally:
            if token is not None and self._store is not None:
                with contextlib.suppress(StateError):
                    await self._store.unlock(lock_name(group), token)

    async def _lock(self, group: str) -> tuple[bool, str | None]:
        """Whether this replica may probe `group` now, and the token of the lock it took.

        Without shared state (one replica) there is no lock to take. With the store
        unreachable a replica probes without one: the lock protects the reading's accuracy
        and not the requests served, so a reading perhaps taken beside another replica's
        probe (its readings decay within a half-life, and the next probe replaces them)
        is worth more than none for as long as Redis is down (the unread pool priced from
        the other through fixed ratios, ~25% off on H200). Such a probe still starts only
        while no server of the group reports a running request, so it overlaps another
        replica's only when both start within one telemetry poll. The attempt is bounded by
        the store's own call timeout, so it never hangs the prober.
        """
        if self._store is None:
            return True, None
        try:
            token = await self._store.try_lock(lock_name(group), lock_ttl_s(self._settings))
        except StateError:
            return True, None
        return token is not None, token

    def _context(self, group: str, pool: Pool) -> int:
        """The prompt tokens this probe of `pool` decodes at (`probe_context`)."""
        learner = self._monitor.learning.learner(group)
        return probe_context(self._monitor.learning.traffic_context(group),
                             self._settings.prompt_tokens, self._settings.max_prompt_tokens,
                             learner.kv_tokens[pool])

    async def _measure(self, group: str, pool: Pool) -> Outcome:
        """The probe itself, within `timeout_s` in all: the warm-up that prefills its
        prefix, then the rounds of each batch (`_read_batches`)."""
        learner = self._monitor.learning.learner(group)
        context = self._context(group, pool)
        prefix = probe_prefix(context)
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                backend = self._idle_backend(group, pool)
                if backend is None:
                    return "busy"
                if await self._round(group, pool, backend, 1, 1, prefix, warm_up=True):
                    outcome = await self._read_batches(group, pool, context, prefix)
                    if outcome is not None:
                        return outcome
        except _Cancelled:
            learner.note_probe(pool, "cancelled")
            return "cancelled"
        except TimeoutError:
            log.info("cost probe of %s in group %s ran out of its %.1f s", pool, group,
                     self._settings.timeout_s)
        learner.note_probe(pool, "failed")
        self._not_before[group, pool] = self._monitor.clock() + _FAILED_RETRY_S
        return "failed"

    async def _read_batches(self, group: str, pool: Pool, context: int,
                            prefix: list[int]) -> Outcome | None:
        """A short and a long round at each of the pool's batches, each reading folded in
        and published: "read", "busy", or None when no step could be read."""
        learner = self._monitor.learning.learner(group)
        for batch in self._settings.batches(pool):
            backend = await self._settled_backend(group, pool)
            if backend is None:
                return "busy"
            short = await self._round(group, pool, backend, batch, 1, prefix)
            long = await self._round(group, pool, backend, batch, self._settings.tokens, prefix)
            ms = None if short is None or long is None else step_reading(short, long)
            if ms is None:
                return None
            learner.observe(pool, batch, ms, self._monitor.clock(), PROBE_WEIGHT, probe=True,
                            context=context)
            log.info("cost probe of %s (%s, group %s) at batch %d, %d prompt tokens: %.3f ms "
                     "a step", backend.name, pool, group, batch, context, ms)
            await self._publish(group, pool, batch, ms, context)
        return "read"

    async def _publish(self, group: str, pool: Pool, batch: int, ms: float,
                       context: int) -> None:
        """Share a reading with the other replicas (best effort: they probe themselves
        when it does not reach them)."""
        if self._store is None:
            return
        reading = ProbeReading(group, pool, float(batch), ms, time.time(),
                               self._store.replica_id, uuid.uuid4().hex, float(context))
        with contextlib.suppress(StateError):
            await self._store.publish_reading(reading)

    def _fold_taken(self) -> None:
        """Fold in the readings other replicas published, as of the store's last sync."""
        if self._store is not None:
            self._fold(self._store.take_readings())

    async def _fold_fresh(self) -> None:
        """Fold in the readings published up to now (the lock's holder reads them before
        it probes: a pool another replica read just before it released the lock is not
        probed again)."""
        if self._store is None:
            return
        with contextlib.suppress(StateError):
            self._fold(await self._store.fetch_readings())

    def _fold(self, readings: list[ProbeReading]) -> None:
        """Other replicas' probe readings into the learners, each weighing what it would
        weigh now had this replica read it itself (`PROBE_WEIGHT` halved every half-life
        of its age)."""
        now, wall = self._monitor.clock(), time.time()
        groups = set(self._monitor.learning.groups)
        for reading in readings:
            pool = next((p for p in POOLS if p == reading.pool), None)
            if reading.group not in groups or pool is None:
                continue
            learner = self._monitor.learning.learner(reading.group)
            age = max(0.0, wall - reading.at)
            weight = PROBE_WEIGHT * 0.5 ** (age / learner.half_life_s)
            if weight < _MIN_SHARED_WEIGHT:
                continue
            learner.observe(pool, reading.batch, reading.step_ms, now, weight,
                            context=reading.context)
            learner.note_probe(pool, "shared")

    async def _round(self, group: str, pool: Pool, backend: Backend, batch: int,
                     tokens: int, prefix: list[int], *,
                     warm_up: bool = False) -> list[ProbeAnswer] | None:
        """`batch` generations of `tokens` after `prefix` sent together (`warm_up`: the
        prefix alone, which the later rounds then find cached); cancelled (`_Cancelled`) as
        soon as the group holds a request that is not one of them. Generations that are
        still running when it ends (cancelled, or out of time) are aborted on the server."""
        prefill = len(prefix) if warm_up else SUFFIX_TOKENS
        targets = probe_targets(group, pool, backend, batch, prefill)
        rids = [f"{PROBE_RID_PREFIX}{uuid.uuid4().hex}" for _ in targets]
        for target in targets:
            self._router.acquire(target)
        bodies = [cost_probe_body(prefix, tokens, rid, suffix=not warm_up) for rid in rids]
        tasks = [asyncio.get_running_loop().create_task(self._one(backend, pool, body))
                 for body in bodies]
        try:
            while not all(t.done() for t in tasks):
                if self._group_inflight(group) > batch:
                    raise _Cancelled
                await asyncio.wait(tasks, timeout=_WATCH_S)
            answers = [t.result() for t in tasks]
        finally:
            if not all(t.done() for t in tasks):
                await cancel_and_wait(tasks)
                await asyncio.gather(*(self._abort(backend, rid) for rid in rids))
            for target in targets:
                self._router.release(target)
        return None if any(a is None for a in answers) else [a for a in answers if a]

    async def _abort(self, backend: Backend, rid: str) -> None:
        """Stop a cancelled probe on the server now (best effort)."""
        with contextlib.suppress(UpstreamError, TimeoutError):
            async with asyncio.timeout(_ABORT_S):
                await send_abort(self._upstreams[backend.name], rid, self._headers(backend))

    @staticmethod
    def _headers(backend: Backend) -> RawHeaders:
        authorization = backend.authorization
        return [*JSON_HEADERS, *([] if authorization is None else
                                 [(b"authorization", authorization)])]

    async def _one(self, backend: Backend, pool: Pool, body: bytes) -> ProbeAnswer | None:
        headers = self._headers(backend)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                response = await self._upstreams[backend.name].open(
                    "POST", PROBE_PATH, headers, body, stream=False)
                try:
                    raw = b"".join([chunk async for chunk in response.iter_raw()])
                finally:
                    await response.aclose()
        except (UpstreamError, TimeoutError) as exc:
            log.info("cost probe of %s failed: %s", backend.name, exc or "timed out")
            return None
        if response.status != 200:
            return None
        return parse_answer(raw, pool, 1000.0 * (time.monotonic() - started))
