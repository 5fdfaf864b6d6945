"""The StateStore interface: what the router may ask of shared state, and nothing more.

The request path only calls the synchronous methods (`acquire`, `release`, `cluster_inflight`,
`get_policy`, `status`); they touch local memory only, so they never block and never raise
because of Redis. Everything that talks to Redis is either a background task or an explicitly
`async` admin call (`put_policy`, `ensure_policy`, `audit`).

The state layer knows nothing about the router's Policy model: a policy is an opaque JSON
object (a dict) with a version; the router validates it before calling `put_policy`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

log = logging.getLogger("specrouter.state")

PolicyDoc = Mapping[str, Any]
PolicyListener = Callable[["PolicyRecord"], None]

_REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
#: Shared cost-probe readings kept: three a probe cycle (two EAGLE-3 batches and one
#: baseline) for about ten groups.
PROBE_READINGS_CAP = 32


class StateError(Exception):
    """Base of the errors the async admin calls may raise (never the request-path calls)."""


class StateUnavailable(StateError):
    """Redis cannot be reached now; the write was NOT applied anywhere (answer 503, retry)."""


class VersionConflict(StateError):
    """`expected_version` did not match: someone else changed the policy first (answer 409)."""

    def __init__(self, expected: int, current: PolicyRecord | None) -> None:
        self.expected = expected
        self.current = current
        have = 0 if current is None else current.version
        super().__init__(f"policy version conflict: expected {expected}, current is {have}")


@dataclass(frozen=True)
class PolicyRecord:
    """A policy document as stored: the doc is opaque JSON, `version` increases by 1 per write."""

    doc: Mapping[str, Any]
    version: int
    updated_at: float  # unix seconds (Redis server clock in Redis mode)
    updated_by: str = ""


@dataclass(frozen=True)
class AuditEntry:
    version: int
    updated_at: float
    updated_by: str
    action: str  # "put" (an admin write) or "seed" (a replica re-seeding an empty Redis)
    doc: Mapping[str, Any]

    @classmethod
    def from_json(cls, raw: str | bytes) -> AuditEntry:
        data = json.loads(raw)
        return cls(
            version=int(data["version"]),
            updated_at=float(data["updated_at"]),
            updated_by=str(data.get("updated_by", "")),
            action=str(data.get("action", "put")),
            doc=data["doc"],
        )


@dataclass(frozen=True)
class ProbeReading:
    """One cost-probe reading as replicas share it: `pool` of `group` decoded `batch`
    requests in steps of `step_ms`, read at unix time `at` by replica `by`, at `context`
    prompt tokens (0: not known, a reading of an older replica); `id` is unique per
    reading, so a replica folds each one in once."""

    group: str
    pool: str
    batch: float
    step_ms: float
    at: float
    by: str
    id: str
    context: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"group": self.group, "pool": self.pool, "batch": self.batch,
                           "step_ms": self.step_ms, "at": self.at, "by": self.by,
                           "id": self.id, "context": self.context}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ProbeReading | None:
        """The reading, or None for anything this version cannot read (written by
        someone else)."""
        try:
            data = json.loads(raw)
            reading = cls(str(data["group"]), str(data["pool"]), float(data["batch"]),
                          float(data["step_ms"]), float(data["at"]), str(data["by"]),
                          str(data["id"]), float(data.get("context", 0.0)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        numbers = (reading.batch, reading.step_ms, reading.at, reading.context)
        return reading if all(math.isfinite(x) for x in numbers) else None


class SeenReadings:
    """The readings a replica has not handed out yet, each once: the ids of the last
    `cap` readings seen are remembered, so a re-read of the shared list (after a
    reconnect) hands out only the new ones."""

    def __init__(self, replica_id: str, cap: int) -> None:
        self._replica_id = replica_id
        self._seen: dict[str, None] = {}
        self._cap = cap
        self._new: list[ProbeReading] = []

    def offer(self, reading: ProbeReading) -> None:
        if reading.id in self._seen:
            return
        self._seen[reading.id] = None
        if len(self._seen) > self._cap:
            del self._seen[next(iter(self._seen))]
        if reading.by != self._replica_id:
            self._new.append(reading)

    def take(self) -> list[ProbeReading]:
        new, self._new = self._new, []
        return new


def encode_doc(doc: PolicyDoc) -> str:
    """Canonical JSON of a policy doc; a doc that is not a JSON object is refused early."""
    if not isinstance(doc, Mapping):
        raise TypeError(f"policy doc must be a JSON object (a mapping), got {type(doc).__name__}")
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)


def check_replica_id(replica_id: str) -> str:
    if not _REPLICA_ID_RE.match(replica_id):
        raise ValueError(
            f"replica_id must be 1-128 of [A-Za-z0-9_.-] (it is part of a Redis key), "
            f"got {replica_id!r}"
        )
    return replica_id


class LocalCounts:
    """This replica's exact in-flight counts. Plain dict arithmetic: the request path's cost.

    Not thread-safe: call from the event loop thread (the router is asyncio).
    """

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._counts: dict[str, int] = {}
        self._on_change = on_change

    def add(self, backend: str, delta: int) -> int:
        current = self._counts.get(backend, 0)
        new = current + delta
        if new < 0:
            # A release without its acquire is a bug in the caller; clamping keeps the cluster
            # view sane (never negative) while the warning points at the bug.
            log.warning(
                "state: release of %s below zero (count %d, delta %d): clamped to 0",
                backend, current, delta,
            )
            new = 0
        if new:
            self._counts[backend] = new
        else:
            self._counts.pop(backend, None)
        if new != current and self._on_change is not None:
            self._on_change()
        return new

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def clear(self) -> None:
        self._counts.clear()
        if self._on_change is not None:
            self._on_change()


class Lease:
    """One acquired slot; `release()` is idempotent, so a disconnect racing a normal finish
    (both calling release) can never release twice. Use as a context manager or call
    `release()` in a `finally`."""

    __slots__ = ("_released", "_store", "backend")

    def __init__(self, store: StateStore, backend: str) -> None:
        self._store = store
        self.backend = backend
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store.release(self.backend)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass
class PolicyCache:
    """The local copy of the policy plus its listeners; adopts only strictly newer versions,
    so pub/sub, reconcile and our own writes can race without flapping."""

    record: PolicyRecord | None = None
    listeners: list[PolicyListener] = field(default_factory=list)

    def adopt(self, record: PolicyRecord, force: bool = False) -> bool:
        if not force and self.record is not None and record.version <= self.record.version:
            return False
        self.record = record
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # a buggy listener must not stop propagation to the others
                log.exception("state: policy listener %r failed", listener)
        return True

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        self.listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self.listeners:
                self.listeners.remove(listener)

        return unsubscribe


class StateStore(ABC):
    """Shared state of the router replicas. See docs/state.md for the guarantees."""

    replica_id: str

    # -- lifecycle -------------------------------------------------------------------------
    @abstractmethod
    async def start(self) -> None:
        """Start background tasks. Never raises because Redis is down (the store starts
        degraded and keeps reconnecting)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop background tasks; withdraw this replica's counts (best effort)."""

    # -- in-flight counts (request path: synchronous, never blocks, never raises) ---------
    @abstractmethod
    def add(self, backend: str, delta: int) -> int:
        """Change this replica's count for `backend` by `delta`; returns the new local count
        (clamped at 0)."""

    def acquire(self, backend: str) -> Lease:
        """Count one request on `backend`; release the returned lease exactly once."""
        self.add(backend, 1)
        return Lease(self, backend)

    def release(self, backend: str) -> None:
        """Uncount one request; prefer `Lease.release()`, which is idempotent."""
        self.add(backend, -1)

    @abstractmethod
    def local_inflight(self) -> Mapping[str, int]:
        """This replica's exact counts (backends with a zero count are absent)."""

    @abstractmethod
    def cluster_inflight(self) -> Mapping[str, int]:
        """Counts of all replicas: other replicas' last published counts + my exact counts.
        A snapshot dict; backends with a zero count are absent."""

    # -- policy ----------------------------------------------------------------------------
    @abstractmethod
    def get_policy(self) -> PolicyRecord | None:
        """The policy in force, from the local cache (never touches Redis)."""

    @abstractmethod
    async def put_policy(
        self, doc: PolicyDoc, expected_version: int | None = None, actor: str = ""
    ) -> PolicyRecord:
        """Store `doc` as the next version, atomically. `expected_version`: compare-and-set
        (0 means "only if there is no policy yet"); None: unconditional.
        Raises VersionConflict, StateUnavailable (Redis down: nothing applied)."""

    @abstractmethod
    async def ensure_policy(self, doc: PolicyDoc, actor: str = "startup") -> PolicyRecord:
        """At startup: adopt the shared policy if there is one, else store `doc` as version 1.
        Never raises for Redis being down: then `doc` is held locally as version 0 and
        written (or replaced by the shared one) once Redis answers."""

    def on_policy_change(self, callback: PolicyListener) -> Callable[[], None]:
        """Call `callback(record)` on the event loop whenever a newer policy is adopted
        (from this replica's writes, pub/sub or reconcile). Returns an unsubscribe function.
        Callbacks must be quick and must not block."""
        return self._policy.subscribe(callback)

    @abstractmethod
    async def audit(self, limit: int = 50) -> list[AuditEntry]:
        """The last `limit` policy changes, newest first. Raises StateUnavailable."""

    # -- cluster-wide locks and cost-probe readings (background tasks only) ----------------
    @abstractmethod
    async def try_lock(self, name: str, ttl_s: float) -> str | None:
        """Take the cluster-wide lock `name` for at most `ttl_s` seconds: the token that
        releases it, or None while another holder has it. A holder that dies loses it when
        the ttl runs out. Raises StateUnavailable when Redis cannot be reached (nothing
        taken)."""

    @abstractmethod
    async def unlock(self, name: str, token: str) -> None:
        """Release `name` if `token` still holds it (compare-and-delete: a lock that
        expired and was taken by another holder is left to it). Raises StateUnavailable."""

    @abstractmethod
    async def publish_reading(self, reading: ProbeReading) -> None:
        """Share a cost-probe reading with every replica (the last `PROBE_READINGS_CAP`
        are kept). Raises StateUnavailable."""

    @abstractmethod
    def take_readings(self) -> list[ProbeReading]:
        """Readings other replicas published that this one has not taken yet, each
        once, as of the last sync (local memory only: never touches Redis)."""

    @abstractmethod
    async def fetch_readings(self) -> list[ProbeReading]:
        """`take_readings` as of now: reads what was published since the last sync.
        Raises StateUnavailable."""

    # -- introspection ---------------------------------------------------------------------
    @abstractmethod
    def status(self) -> dict[str, Any]:
        """For /ready details and metrics: backend, connected, degraded, last_error,
        last_sync_age_s, ... Never contains secrets."""

    _policy: PolicyCache
