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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from specrouter.backends import Backend, Pool
from specrouter.config import CostProbeSettings
from specrouter.observe.loadview import GroupView
from specrouter.proxy.abort import ABORT_PATH
from specrouter.proxy.upstream import RawHeaders, RequestBody, Upstream, UpstreamError
from specrouter.routing.costprobe import (
    PROBE_PATH,
    PROBE_WEIGHT,
    ProbeAnswer,
    cost_probe_body,
    due,
    parse_answer,
    step_reading,
)
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.router import Router, Target
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


#: The order pools are probed in: the baseline's cost is the one a move trusts.
POOLS: tuple[Pool, ...] = ("baseline", "eagle")
#: Seconds between two looks at the group's in-flight count while a probe runs.
_WATCH_S = 0.005
#: Seconds before a pool whose probe failed (no answer a step could be read from) is
#: probed again.
_FAILED_RETRY_S = 60.0
_JSON = (b"content-type", b"application/json")


class _Cancelled(Exception):
    """A request for the group arrived while a probe ran."""


class CostProber:
    """Probes each group's unread pools in the background (`start`, `aclose`)."""

    def __init__(self, router: ProbeHost, upstreams: Mapping[str, Upstream],
                 settings: CostProbeSettings) -> None:
        self._router = router
        self._monitor = router.monitor
        self._upstreams = upstreams
        self._settings = settings
        self._task: asyncio.Task[None] | None = None
        self._not_before: dict[tuple[str, Pool], float] = {}

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
        while True:
            view = self._group(group)
            if all(b.healthy for b in view.backends):
                break
            await asyncio.sleep(_WATCH_S * 10)
        for pool in POOLS:
            if self._due(group, pool):
                await self.probe(group, pool)

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while True:
            for group in self._monitor.learning.groups:
                for pool in POOLS:
                    if self._due(group, pool):
                        await self.probe(group, pool)
            await asyncio.sleep(self._settings.check_s)

    def _due(self, group: str, pool: Pool) -> bool:
        if self._monitor.clock() < self._not_before.get((group, pool), float("-inf")):
            return False
        learned = self._monitor.learning.model(group, self._monitor.clock()).pools[pool]
        return due(learned.weight)

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

    def _group_inflight(self, group: str) -> int:
        return sum(b.inflight for b in self._group(group).backends)

    async def probe(self, group: str, pool: Pool) -> float | None:
        """One probe of `pool` in `group` at each of its configured batches; the step ms
        read at the last batch (None: the group was busy, or the probe was cancelled or failed)."""
        learner = self._monitor.learning.learner(group)
        ms = None
        for batch in self._settings.batches(pool):
            backend = self._idle_backend(group, pool)
            if backend is None:
                return None
            try:
                short = await self._round(group, pool, backend, batch, 1)
                long = await self._round(group, pool, backend, batch, self._settings.tokens)
            except _Cancelled:
                learner.note_probe(pool, "cancelled")
                return None
            ms = None if short is None or long is None else step_reading(short, long)
            if ms is None:
                learner.note_probe(pool, "failed")
                self._not_before[group, pool] = self._monitor.clock() + _FAILED_RETRY_S
                return None
            learner.observe(pool, batch, ms, self._monitor.clock(), PROBE_WEIGHT, probe=True)
            log.info("cost probe of %s (%s, group %s) at batch %d: %.3f ms a step",
                     backend.name, pool, group, batch, ms)
        return ms

    async def _round(self, group: str, pool: Pool, backend: Backend, batch: int,
                     tokens: int) -> list[ProbeAnswer] | None:
        """`batch` generations of `tokens` sent together; cancelled (`_Cancelled`) as soon
        as the group holds a request that is not one of them."""
        targets = [Target(group, pool, backend, "cost_probe") for _ in range(batch)]
        rids = [f"specrouter-cost-probe-{uuid.uuid4().hex}" for _ in targets]
        for target in targets:
            self._router.acquire(target)
        tasks = [asyncio.get_running_loop().create_task(self._one(backend, pool, tokens, rid))
                 for rid in rids]
        try:
            while not all(t.done() for t in tasks):
                if self._group_inflight(group) > batch:
                    await cancel_and_wait(tasks)
                    await asyncio.gather(*(self._abort(backend, rid) for rid in rids))
                    raise _Cancelled
                await asyncio.wait(tasks, timeout=_WATCH_S)
            answers = [t.result() for t in tasks]
        finally:
            await cancel_and_wait(tasks)
            for target in targets:
                self._router.release(target)
        return None if any(a is None for a in answers) else [a for a in answers if a]

    async def _abort(self, backend: Backend, rid: str) -> None:
        """Stop a cancelled probe on the server now (best effort)."""
        body = json.dumps({"rid": rid}).encode()
        with contextlib.suppress(UpstreamError, TimeoutError):
            async with asyncio.timeout(self._settings.timeout_s):
                response = await self._upstreams[backend.name].open(
                    "POST", ABORT_PATH, self._headers(backend), body, stream=False)
                await response.aclose()

    @staticmethod
    def _headers(backend: Backend) -> RawHeaders:
        headers: RawHeaders = [_JSON]
        if backend.api_key is not None:
            headers.append((b"authorization", b"Bearer " + backend.api_key.encode()))
        return headers

    async def _one(self, backend: Backend, pool: Pool, tokens: int,
                   rid: str) -> ProbeAnswer | None:
        headers = self._headers(backend)
        body = cost_probe_body(self._settings.prompt_tokens, tokens, rid)
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
