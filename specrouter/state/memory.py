"""The embedded store: one replica, no Redis. Same semantics as RedisStore with R = 1."""

from __future__ import annotations

import json
import secrets
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

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
    VersionConflict,
    check_replica_id,
    encode_doc,
)


class InMemoryStore(StateStore):
    def __init__(self, replica_id: str = "local", audit_cap: int = 100) -> None:
        self.replica_id = check_replica_id(replica_id)
        self._counts = LocalCounts()
        self._policy = PolicyCache()
        self._audit: deque[AuditEntry] = deque(maxlen=audit_cap)
        self._locks: dict[str, tuple[str, float]] = {}  # name -> token, monotonic expiry
        self._readings = SeenReadings(self.replica_id, 4 * PROBE_READINGS_CAP)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._counts.clear()

    def add(self, backend: str, delta: int) -> int:
        return self._counts.add(backend, delta)

    def local_inflight(self) -> Mapping[str, int]:
        return self._counts.snapshot()

    def cluster_inflight(self) -> Mapping[str, int]:
        return self._counts.snapshot()

    def get_policy(self) -> PolicyRecord | None:
        return self._policy.record

    async def put_policy(
        self, doc: PolicyDoc, expected_version: int | None = None, actor: str = ""
    ) -> PolicyRecord:
        return self._write(doc, expected_version, actor, "put")

    async def ensure_policy(self, doc: PolicyDoc, actor: str = "startup") -> PolicyRecord:
        current = self._policy.record
        if current is not None:
            return current
        return self._write(doc, 0, actor, "put")

    def _write(
        self, doc: PolicyDoc, expected_version: int | None, actor: str, action: str
    ) -> PolicyRecord:
        encoded = encode_doc(doc)  # validates and deep-copies through JSON, like Redis would
        current = self._policy.record
        have = 0 if current is None else current.version
        if expected_version is not None and expected_version != have:
            raise VersionConflict(expected_version, current)
        record = PolicyRecord(json.loads(encoded), have + 1, time.time(), actor)
        self._audit.appendleft(
            AuditEntry(record.version, record.updated_at, actor, action, record.doc)
        )
        self._policy.adopt(record)
        return record

    async def audit(self, limit: int = 50) -> list[AuditEntry]:
        return list(self._audit)[: max(0, limit)]

    async def try_lock(self, name: str, ttl_s: float) -> str | None:
        now = time.monotonic()
        held = self._locks.get(name)
        if held is not None and held[1] > now:
            return None
        token = f"{self.replica_id}:{secrets.token_hex(8)}"
        self._locks[name] = (token, now + ttl_s)
        return token

    async def unlock(self, name: str, token: str) -> None:
        held = self._locks.get(name)
        if held is not None and held[0] == token:
            del self._locks[name]

    async def publish_reading(self, reading: ProbeReading) -> None:
        self._readings.offer(reading)

    def take_readings(self) -> list[ProbeReading]:
        return self._readings.take()

    async def fetch_readings(self) -> list[ProbeReading]:
        return self._readings.take()

    def status(self) -> dict[str, Any]:
        record = self._policy.record
        return {
            "backend": "memory",
            "replica_id": self.replica_id,
            "connected": True,
            "degraded": False,
            "last_error": None,
            "last_sync_age_s": 0.0,
            "policy_version": None if record is None else record.version,
            "replicas_seen": 1,
        }
