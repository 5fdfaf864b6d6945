"""RedisStore: replicas share counts, policy and audit through one Redis, without depending on it.

Design (details and bounds in docs/state.md):
- Counts: each replica owns one hash `{prefix}:inflight:{replica_id}` with a TTL. A background
  publisher rewrites it (one Lua call, atomic) at most every `publish_interval_s` when counts
  changed, and at least every `heartbeat_s` to refresh the TTL. A background refresher reads all
  live replicas' hashes (one Lua call) every `refresh_interval_s`. The request path only touches
  a dict.
- Policy: a hash written by a compare-and-set Lua script (`redis_scripts`) that bumps the
  version, appends the audit entry and publishes the new version, all atomically. Replicas
  adopt newer versions from pub/sub, and a reconcile loop compares versions every
  `reconcile_interval_s` in case a message was lost.
- Locks (`try_lock`): `SET key token NX PX ttl`, released by a compare-and-delete script, so
  a holder that dies loses its lock when the TTL runs out. Cost-probe readings: a stream
  capped at `PROBE_READINGS_CAP` entries, read from the last entry seen at every reconcile
  (from its start again after a reconnect: Redis may have restarted empty, and the ids of
  the readings already taken keep them from being taken twice).
- Failure: any Redis error in a background loop marks the store degraded (logged once), loops
  pause, a supervisor reconnects with exponential backoff and, once Redis answers, republishes
  counts, re-seeds the policy if Redis lost it, and refreshes the view before leaving degraded.
  A reply the store cannot read (a key someone else wrote, or an answer that is not the one
  asked for) is handled the same way, after dropping every pooled connection: no background
  loop may die, because a dead refresh loop would freeze the other replicas' counts in this
  replica's view while the store still looks connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from specrouter.state.base import (
    PROBE_READINGS_CAP,
    AuditEntry,
    LocalCounts,
    PolicyCache,
    PolicyDoc,
    PolicyRecord,
    ProbeReading,
    SeenReadings,
    StateStore,
    StateUnavailable,
    VersionConflict,
    check_replica_id,
    encode_doc,
)
from specrouter.state.keys import KeySchema
from specrouter.state.redis_scripts import RedisScripts, count_of
from specrouter.state.settings import StateSettings

log = logging.getLogger("specrouter.state")

T = TypeVar("T")
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

def _password_of(url: str) -> str | None:
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


class RedisStore(StateStore):
    def __init__(self, settings: StateSettings, replica_id: str) -> None:
        if settings.redis_url is None:
            raise ValueError("RedisStore needs settings.redis_url (use make_store for memory)")
        self.replica_id = check_replica_id(replica_id)
        self.settings = settings
        url = settings.redis_url.get_secret_value()
        self._secrets = [s for s in (_password_of(url), _password_of(unquote(url))) if s]
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.connect_timeout_s,
            retry=Retry(NoBackoff(), 1),  # one retry: a pooled socket may be dead after restart
            decode_responses=True,
            client_name=f"specrouter:{replica_id}",
        )
        # Upper bound of any single Redis call, whatever the socket does (two attempts).
        self._op_timeout = 2 * (settings.connect_timeout_s + settings.socket_timeout_s)
        self._keys = KeySchema(settings.key_prefix)
        self._ttl_ms = int(settings.ttl_s * 1000)
        self._scripts = RedisScripts(self._client, self._keys, self._ttl_ms, settings.audit_cap)

        self._dirty = asyncio.Event()
        self._counts = LocalCounts(on_change=self._dirty.set)
        self._policy = PolicyCache()
        self._others: dict[str, int] = {}
        self._others_at: float | None = None  # monotonic time of the last good refresh
        self._replicas_seen = 0
        self._readings = SeenReadings(replica_id, 4 * PROBE_READINGS_CAP)
        self._readings_cursor = "0-0"  # the last stream entry read
        self._unsure_locks: dict[str, str] = {}  # name -> token of a SET that failed

        self._up = asyncio.Event()
        self._down = asyncio.Event()
        self._down.set()
        self._started = False
        self._closing = False
        self._ever_connected = False
        self._start_failure_logged = False
        self._down_since: float | None = None
        self._last_error: str | None = None
        self._warned: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._down_since = time.monotonic()
        for loop_fn in (
            self._supervisor_loop,
            self._publish_loop,
            self._refresh_loop,
            self._reconcile_loop,
            self._pubsub_loop,
        ):
            self._tasks.append(asyncio.create_task(loop_fn(), name=f"state:{loop_fn.__name__}"))
        # Give the first connection a moment so a healthy start is a synced start; a Redis that
        # is down must not delay startup by more than one connection attempt.
        # (asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._op_timeout * 2):
                await self._up.wait()

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        # Cancel until they are gone: redis-py sends with asyncio.wait_for, which on Python
        # 3.11 swallows a cancellation that lands as the send completes (CPython gh-86296),
        # and the loop would carry on (re-publishing counts after the withdraw below).
        # Bounded: shutdown must not hang on a background task, whatever it is doing.
        deadline = time.monotonic() + self._op_timeout * 2
        pending = set(self._tasks)
        while pending and time.monotonic() < deadline:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.05)
        self._tasks.clear()
        if self._up.is_set():
            with contextlib.suppress(*REDIS_ERRORS):
                await self._call(self._withdraw)
        with contextlib.suppress(*REDIS_ERRORS):
            await self._client.aclose()

    async def _withdraw(self) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._keys.inflight(self.replica_id))
        pipe.zrem(self._keys.replicas, self.replica_id)
        await pipe.execute()

    # -- request path ----------------------------------------------------------------------
    def add(self, backend: str, delta: int) -> int:
        return self._counts.add(backend, delta)

    def local_inflight(self) -> Mapping[str, int]:
        return self._counts.snapshot()

    def cluster_inflight(self) -> Mapping[str, int]:
        others = self._others
        if others and not self._up.is_set() and self._others_expired():
            # Redis is unreachable and what we know of the others is older than their TTL:
            # Redis itself would have dropped it by now, so do we.
            self._others = others = {}
        merged = dict(others)
        for backend, count in self._counts._counts.items():
            merged[backend] = merged.get(backend, 0) + count
        return merged

    def _others_expired(self) -> bool:
        at = self._others_at
        return at is None or time.monotonic() - at > self.settings.ttl_s

    def get_policy(self) -> PolicyRecord | None:
        return self._policy.record

    # -- admin path (async, may raise StateUnavailable / VersionConflict) -------------------
    async def put_policy(
        self, doc: PolicyDoc, expected_version: int | None = None, actor: str = ""
    ) -> PolicyRecord:
        encoded = encode_doc(doc)
        if not self._up.is_set():
            raise StateUnavailable("redis is unreachable; policy not changed")
        held = self._policy.record
        floor = 0 if held is None else held.version
        expected = -1 if expected_version is None else expected_version
        try:
            result = await self._call(
                lambda: self._scripts.compare_and_set(expected, encoded, actor, floor))
            if int(result[0]) == 0:
                current = await self._call(self._read_policy)
                raise VersionConflict(expected, current)
        except REDIS_ERRORS as exc:
            self._mark_degraded(exc)
            raise StateUnavailable(
                f"redis failed during the write ({self._describe(exc)}); the policy may or may "
                "not have changed: read it back before retrying"
            ) from exc
        record = PolicyRecord(json.loads(encoded), int(result[1]), float(result[2]), actor)
        self._policy.adopt(record)
        return record

    async def ensure_policy(self, doc: PolicyDoc, actor: str = "startup") -> PolicyRecord:
        encoded = encode_doc(doc)
        if self._up.is_set():
            try:
                return await self.put_policy(doc, expected_version=0, actor=actor)
            except VersionConflict as conflict:
                if conflict.current is not None:
                    self._policy.adopt(conflict.current)
                    return conflict.current
            except StateUnavailable:
                pass
        held = self._policy.record
        if held is not None:
            return held
        # Redis down at startup: serve with our own policy as version 0; the reconcile after
        # reconnect writes it as version 1 if Redis has none, or adopts the shared one.
        record = PolicyRecord(json.loads(encoded), 0, time.time(), actor)
        self._policy.adopt(record)
        return record

    async def audit(self, limit: int = 50) -> list[AuditEntry]:
        if limit <= 0:
            return []
        if not self._up.is_set():
            raise StateUnavailable("redis is unreachable; audit log not available")
        try:
            raw = await self._call(lambda: self._client.lrange(self._keys.audit, 0, limit - 1))
        except REDIS_ERRORS as exc:
            self._mark_degraded(exc)
            raise StateUnavailable(f"redis failed: {self._describe(exc)}") from exc
        return [AuditEntry.from_json(item) for item in raw]

    # -- locks and cost-probe readings (background tasks; may raise StateUnavailable) -------
    async def try_lock(self, name: str, ttl_s: float) -> str | None:
        """A SET that failed may still have been applied (a hung Redis runs it once it
        wakes): its token is released on reconnect, so such a lock does not shut every
        replica out for its whole TTL."""
        token = f"{self.replica_id}:{secrets.token_hex(8)}"
        ttl_ms = max(1, round(ttl_s * 1000))
        try:
            taken = await self._shared(
                lambda: self._client.set(self._keys.lock(name), token, nx=True, px=ttl_ms))
        except StateUnavailable:
            self._unsure_locks[name] = token
            raise
        return token if taken else None

    async def unlock(self, name: str, token: str) -> None:
        await self._shared(lambda: self._scripts.unlock(name, token))

    async def publish_reading(self, reading: ProbeReading) -> None:
        await self._shared(lambda: self._client.xadd(
            self._keys.probe_readings, {"r": reading.to_json()}, maxlen=PROBE_READINGS_CAP,
            approximate=False))

    def take_readings(self) -> list[ProbeReading]:
        return self._readings.take()

    async def fetch_readings(self) -> list[ProbeReading]:
        await self._shared(self._read_readings)
        return self._readings.take()

    async def _shared(self, fn: Callable[[], Awaitable[T]]) -> T:
        """One call of a background task: StateUnavailable when Redis is down, fails or
        answers what the store cannot read (then handled like a background loop's
        failure: degraded until the supervisor reconnects)."""
        if not self._up.is_set():
            raise StateUnavailable("redis is unreachable")
        try:
            return await self._call(fn)
        except Exception as exc:
            await self._distrust_connections_after(exc)
            self._mark_degraded(exc)
            raise StateUnavailable(f"redis failed: {self._describe(exc)}") from exc

    # -- introspection ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        record = self._policy.record
        now = time.monotonic()
        connected = self._up.is_set()
        return {
            "backend": "redis",
            "replica_id": self.replica_id,
            "url": self.settings.redacted_url,
            "key_prefix": self.settings.key_prefix,
            "connected": connected,
            "degraded": self._started and not connected,
            "last_error": self._last_error,
            "last_sync_age_s": None if self._others_at is None else round(now - self._others_at, 3),
            "degraded_for_s": (
                None if connected or self._down_since is None else round(now - self._down_since, 3)
            ),
            "policy_version": None if record is None else record.version,
            "replicas_seen": self._replicas_seen,
        }

    # -- background loops ------------------------------------------------------------------
    async def _supervisor_loop(self) -> None:
        """While degraded: reconnect with exponential backoff (jittered), then resync."""
        while True:
            await self._down.wait()
            delay = self.settings.backoff_initial_s
            while True:
                try:
                    await self._resync()
                except Exception as exc:
                    await self._distrust_connections_after(exc)
                    self._note_failure(exc)
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                    delay = min(delay * 2, self.settings.backoff_max_s)
                    continue
                self._mark_up()
                break

    async def _resync(self) -> None:
        """Make Redis whole again from what this replica holds, before leaving degraded."""
        await self._call(self._client.ping)
        self._dirty.clear()
        await self._call(self._publish)
        await self._call(self._sync_policy)
        await self._call(self._refresh)
        self._readings_cursor = "0-0"
        await self._call(self._read_readings)
        for name, token in list(self._unsure_locks.items()):
            await self._call(partial(self._scripts.unlock, name, token))
            del self._unsure_locks[name]

    async def _publish_loop(self) -> None:
        while True:
            await self._up.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_s):
                    await self._dirty.wait()
            if not self._up.is_set():
                continue  # the supervisor republishes on reconnect
            self._dirty.clear()
            await self._guarded(self._publish)
            # Coalesce: changes during this pause go out together in the next call.
            await asyncio.sleep(self.settings.publish_interval_s)

    async def _refresh_loop(self) -> None:
        while True:
            await self._up.wait()
            await self._guarded(self._refresh)
            await asyncio.sleep(self.settings.refresh_interval_s)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reconcile_interval_s)
            await self._up.wait()
            await self._guarded(self._reconcile_version)
            await self._guarded(self._read_readings)

    async def _pubsub_loop(self) -> None:
        """Fast path of policy propagation. Its errors never mark the store degraded (the
        other loops judge health); it just resubscribes, and reconcile covers the gap."""
        while True:
            await self._up.wait()
            pubsub = self._client.pubsub()
            try:
                await self._call(partial(pubsub.subscribe, self._keys.policy_channel))
                # Subscribed: a change made before this point is caught by this sync.
                await self._guarded(self._sync_policy)
                while self._up.is_set():
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.settings.socket_timeout_s
                    )
                    if message is not None and message.get("type") == "message":
                        await self._guarded(self._sync_policy)
            except Exception as exc:
                if isinstance(exc, REDIS_ERRORS):
                    log.debug("state: pub/sub connection lost (%s)", self._describe(exc))
                else:
                    self._log_unexpected(exc)
                await asyncio.sleep(self.settings.backoff_initial_s)
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await self._call(pubsub.aclose)

    # -- Redis operations (each raises on failure; callers decide) --------------------------
    async def _publish(self) -> None:
        await self._scripts.publish(self.replica_id, self._counts.snapshot())

    async def _refresh(self) -> None:
        raw = await self._scripts.refresh()
        others: dict[str, int] = {}
        seen = 0
        for i in range(0, len(raw), 2):
            seen += 1
            if raw[i] == self.replica_id:
                continue  # our own counts come from the exact local counter
            fields = raw[i + 1]
            for j in range(0, len(fields), 2):
                count = count_of(fields[j + 1])
                if count is None:
                    self._warn_once(f"state: replica {raw[i]!r} published a count for "
                                    f"{fields[j]!r} that is not an integer; it is ignored")
                elif count > 0:
                    others[fields[j]] = others.get(fields[j], 0) + count
        self._others = others
        self._others_at = time.monotonic()
        self._replicas_seen = max(seen, 1)

    async def _read_readings(self) -> None:
        """Take the readings published since the last one read."""
        raw: Any = await self._client.xread(
            {self._keys.probe_readings: self._readings_cursor}, count=4 * PROBE_READINGS_CAP)
        for _stream, entries in raw or ():
            for entry_id, fields in entries:
                self._readings_cursor = entry_id
                reading = ProbeReading.from_json(fields.get("r", ""))
                if reading is None:
                    self._warn_once(f"state: a cost-probe reading in "
                                    f"{self._keys.probe_readings} cannot be read; ignored")
                else:
                    self._readings.offer(reading)

    async def _reconcile_version(self) -> None:
        stored = await self._client.hget(self._keys.policy, "version")
        held = self._policy.record
        if held is None or count_of(stored) != held.version:
            await self._sync_policy()

    async def _read_policy(self) -> PolicyRecord | None:
        raw = await self._client.hgetall(self._keys.policy)
        if not raw or "doc" not in raw:
            return None
        try:
            doc = json.loads(raw["doc"])
            if not isinstance(doc, dict):
                raise ValueError("the doc is not a JSON object")
            return PolicyRecord(
                doc=doc,
                version=int(raw["version"]),
                updated_at=float(raw.get("updated_at", 0.0)),
                updated_by=str(raw.get("updated_by", "")),
            )
        except (KeyError, ValueError, TypeError) as exc:
            # Not ours to read: treated as no policy, so ours is seeded over it.
            self._warn_once(f"state: the policy stored at {self._keys.policy} cannot be read "
                            f"({type(exc).__name__}: {exc}); writing this replica's over it")
            return None

    async def _sync_policy(self) -> None:
        """Converge on the highest version: adopt Redis's if newer, re-seed ours if Redis lost
        it (restarted empty) or holds an older one."""
        stored = await self._read_policy()
        held = self._policy.record
        if stored is not None and (held is None or stored.version > held.version):
            self._policy.adopt(stored)
            return
        if held is None or (stored is not None and stored.version == held.version):
            return
        result = await self._scripts.seed(
            held.version, encode_doc(held.doc), held.updated_by or self.replica_id,
            repr(held.updated_at) if held.version >= 1 else "")
        if int(result[0]) == 1:
            version = int(result[1])
            if version != held.version:  # a version-0 startup policy became version 1
                self._policy.adopt(PolicyRecord(held.doc, version, float(result[2]),
                                                held.updated_by))
            log.info("state: re-seeded redis with policy version %d", version)
        else:
            newer = await self._read_policy()
            if newer is not None:
                self._policy.adopt(newer)

    # -- health bookkeeping ----------------------------------------------------------------
    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        async with asyncio.timeout(self._op_timeout):
            return await fn()

    async def _guarded(self, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await self._call(fn)
        except Exception as exc:
            await self._distrust_connections_after(exc)
            self._mark_degraded(exc)

    async def _distrust_connections_after(self, exc: Exception) -> None:
        """After a reply we could not read (anything but a Redis error), no pooled
        connection is trusted: one may still hold the answer to an earlier command, and
        would hand it to the next one."""
        if isinstance(exc, REDIS_ERRORS):
            return
        self._log_unexpected(exc)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._op_timeout):
                await self._client.connection_pool.disconnect()

    def _log_unexpected(self, exc: BaseException) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        log.error("state: unexpected error from redis %s (%s%s); reconnecting",
                  self.settings.redacted_url, self._describe(exc), where)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)

    def _mark_degraded(self, exc: BaseException) -> None:
        self._note_failure(exc)
        if self._up.is_set():
            self._up.clear()
            self._down.set()
            self._down_since = time.monotonic()
            log.warning(
                "state: redis %s unreachable (%s); serving from the local view until it is back",
                self.settings.redacted_url, self._last_error,
            )

    def _note_failure(self, exc: BaseException) -> None:
        self._last_error = self._describe(exc)
        if not self._ever_connected and not self._start_failure_logged:
            self._start_failure_logged = True
            log.warning(
                "state: redis %s not reachable at start (%s); serving from the local view, "
                "retrying with backoff", self.settings.redacted_url, self._last_error,
            )

    def _mark_up(self) -> None:
        was_down_for = None if self._down_since is None else time.monotonic() - self._down_since
        self._down.clear()
        self._up.set()
        self._dirty.set()
        if self._ever_connected:
            log.warning("state: redis %s is back after %.1f s; counts republished",
                        self.settings.redacted_url, was_down_for or 0.0)
        else:
            log.info("state: connected to redis %s", self.settings.redacted_url)
        self._ever_connected = True
        self._down_since = None

    def _describe(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"[:300]
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text
