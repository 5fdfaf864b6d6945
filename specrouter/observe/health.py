"""Health of each backend: active checks in the background, passive outcomes, breakers.

Active checks find a backend that is down before a request hits it, and find it back up.
SGLang's cheap `GET /ready` is used where it exists (SGLang 0.5.23+); a backend that
answers it 404 or 405 is checked with `GET /health`, which runs a one-token generation and
gets its own long timeout. The path that works is remembered per backend and detected
again after a connection failure (another SGLang version may be behind the URL).
`/ready` answers 200 for a wedged scheduler, so a backend checked with it also gets a
`GET /health_generate` every `generation_check_s` (SGLang does not queue that generation
behind a busy batch: no answer within the timeout means the scheduler makes no progress),
and at every check while the last one failed. A check that fails for the router's own
lack of resources (`local_errors`) changes nothing. Passive outcomes of real requests feed
each backend's circuit breaker (`specrouter.observe.breaker`).

The state machines are pure (`breaker.HealthRecord`); this module owns the clock, the
HTTP client and the background loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from specrouter.backends import Backend
from specrouter.config import HealthSettings
from specrouter.observe.breaker import BreakerConfig, HealthRecord
from specrouter.observe.local_errors import LocalFailure, RateLimitedLog, local_resource_error
from specrouter.tasks import cancel_and_wait

log = logging.getLogger("specrouter.observe.health")

READY_PATH = "/ready"
HEALTH_PATH = "/health"
GENERATION_PATH = "/health_generate"
_NO_READY = frozenset({404, 405})  # no /ready: SGLang before 0.5.23


class HealthChecker:
    """Per-backend health records, kept current by one background loop per backend."""

    def __init__(
        self,
        backends: Sequence[Backend],
        settings: HealthSettings,
        breaker: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._backends = tuple(backends)
        self._settings = settings
        self._clock = clock
        self.records: dict[str, HealthRecord] = {b.name: HealthRecord(breaker)
                                                 for b in self._backends}
        self._paths: dict[str, str | None] = dict.fromkeys(self.records)
        self._client = client
        self._own_client = client is None
        self._tasks: list[asyncio.Task[None]] = []
        self._was_healthy: dict[str, bool] = dict.fromkeys(self.records, True)
        # per backend: when its last generation check ran and what it found (None: fine)
        self._generation_at: dict[str, float] = {}
        self._generation_error: dict[str, str | None] = dict.fromkeys(self.records)
        self._local_log = RateLimitedLog(log, clock=clock)
        # bumped whenever a record's health changes (`HealthRecord.on_change`)
        self._version = 0
        for record in self.records.values():
            record.on_change = self._health_changed
        # (names, version, flags) while every breaker among `names` is closed
        self._flags: tuple[tuple[str, ...], int, tuple[bool, ...]] | None = None

    # -- request path (synchronous, no I/O) ----------------------------------------------

    def healthy(self, name: str, now: float | None = None) -> bool:
        return self.records[name].healthy(self._clock() if now is None else now)

    def flags(self, names: tuple[str, ...], now: float) -> tuple[bool, ...]:
        """`healthy(name, now)` for each of `names`, in their order. While their breakers
        are all closed the answers change only when a record changes, so the same tuple
        is returned until then: a decision costs no health read per backend. An open or
        half-open breaker depends on the clock, and the flags are read each time."""
        kept = self._flags
        if kept is not None and kept[0] is names and kept[1] == self._version:
            return kept[2]
        records = self.records
        flags = tuple(records[n].healthy(now) for n in names)
        settled = all(records[n].breaker.closed for n in names)
        self._flags = (names, self._version, flags) if settled else None
        return flags

    def _health_changed(self) -> None:
        self._version += 1

    def claim(self, name: str, now: float | None = None) -> float | None:
        """Call when dispatching to `name`: in half-open state this takes the trial slot.
        Returns when the slot was taken (None: this dispatch took none), which
        `end_trial` is given as the request ends."""
        return self.records[name].claim(self._clock() if now is None else now)

    def end_trial(self, name: str, claimed_at: float) -> None:
        """The request that took `name`'s trial slot at `claimed_at` ended: a trial it
        gave no outcome frees the slot (`CircuitBreaker.end_trial`)."""
        self.records[name].end_trial(claimed_at)

    def record_outcome(self, name: str, ok: bool, error: str | None = None) -> None:
        record = self.records[name]
        if record.unchanged_by(ok):
            return  # no clock read, no transition to log
        record.record_outcome(ok, self._clock(), error)
        self._log_transition(name)

    # -- introspection ---------------------------------------------------------------------

    def breaker_state(self, name: str) -> str:
        return self.records[name].breaker.state(self._clock()).value

    def describe(self, name: str) -> dict[str, Any]:
        info = self.records[name].as_dict(self._clock())
        info["check_path"] = self._paths[name]
        info["generation_check_error"] = self._generation_error[name]
        return info

    # -- active checks ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks or not self._settings.enabled:
            return
        if self._client is None:
            # A fresh connection per check: a backend that stopped accepting connections
            # fails its check even while an old keep-alive connection still works. No
            # proxies from the environment for backend traffic.
            self._client = httpx.AsyncClient(
                trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
        self._tasks = [asyncio.create_task(self._loop(b), name=f"health-{b.name}")
                       for b in self._backends]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self, backend: Backend) -> None:
        while True:
            started = self._clock()
            try:
                await self.check_once(backend)
            except Exception:  # a bug in one check must not end health checking for good
                log.exception("health check of %s failed unexpectedly", backend.name)
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self._settings.interval_s - elapsed))

    async def check_once(self, backend: Backend) -> bool:
        """One active check of `backend`; records and returns the verdict. A check that
        failed on the router's side records nothing and returns the last verdict."""
        try:
            ok, error = await self._check(backend)
        except LocalFailure as exc:
            self._local_log.warning(
                backend.name, "health check of %s failed on the router's side (%s): the "
                "backend keeps its last state", backend.name, exc)
            return self.healthy(backend.name)
        self.records[backend.name].record_check(ok, self._clock(), error)
        self._log_transition(backend.name)
        return ok

    async def _check(self, backend: Backend) -> tuple[bool, str | None]:
        name = backend.name
        if self._paths[name] != HEALTH_PATH:
            status, error = await self._get(backend, READY_PATH, self._settings.ready_timeout_s)
            if status is not None and status not in _NO_READY:
                self._paths[name] = READY_PATH
                if status != 200:
                    return False, f"{READY_PATH}: HTTP {status}"
                wedged = await self._generation_check(backend)
                return wedged is None, wedged
            if status is None:
                return False, error
            self._paths[name] = HEALTH_PATH
        status, error = await self._get(backend, HEALTH_PATH, self._settings.health_timeout_s)
        if status is None:
            return False, error
        return status == 200, None if status == 200 else f"{HEALTH_PATH}: HTTP {status}"

    async def _generation_check(self, backend: Backend) -> str | None:
        """Why `backend` counts as wedged while its /ready answers 200, or None. Runs
        the generation when due, else repeats the last verdict (a passed one)."""
        name, every = backend.name, self._settings.generation_check_s
        now = self._clock()
        last = self._generation_at.get(name)
        due = self._generation_error[name] is not None or last is None or now - last >= every
        if every <= 0 or not due:
            return None
        self._generation_at[name] = now
        timeout = self._settings.generation_timeout_s
        status, error = await self._get(backend, GENERATION_PATH, timeout)
        if status == 200:
            verdict = None
        elif status is None:
            verdict = f"wedged: {error} while {READY_PATH} answers 200"
        else:
            verdict = f"wedged: {GENERATION_PATH}: HTTP {status} while {READY_PATH} answers 200"
        if verdict != self._generation_error[name]:
            log.log(logging.WARNING if verdict else logging.INFO, "backend %s: %s", name,
                    verdict or f"{GENERATION_PATH} answers again")
        self._generation_error[name] = verdict
        return verdict

    async def _get(self, backend: Backend, path: str,
                   timeout: float) -> tuple[int | None, str]:
        """(status, "") or (None, what went wrong); LocalFailure when the router itself
        could not make the request."""
        assert self._client is not None, "call start() first"
        try:
            response = await self._client.get(backend.url + path, timeout=timeout)
        except httpx.TimeoutException:
            return None, f"{path}: no answer within {timeout:g}s"
        except (httpx.HTTPError, OSError) as exc:
            local = local_resource_error(exc)
            if local is not None:
                raise LocalFailure(f"{path}: {local}") from exc
            self._paths[backend.name] = None  # the path is detected again
            return None, f"{path}: {type(exc).__name__}"
        return response.status_code, ""

    def _log_transition(self, name: str) -> None:
        now_healthy = self.healthy(name)
        if now_healthy != self._was_healthy[name]:
            self._was_healthy[name] = now_healthy
            record = self.records[name]
            if now_healthy:
                log.info("backend %s is healthy again", name)
            else:
                log.warning("backend %s is unhealthy (breaker %s, last error: %s)", name,
                            record.breaker.state(self._clock()).value, record.last_error)
