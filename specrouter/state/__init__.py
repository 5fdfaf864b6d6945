"""Shared state of router replicas: in-flight counts, the policy, its audit log.

Use `make_store(settings, replica_id)`; see `StateStore` (base.py) and docs/state.md.
"""

from __future__ import annotations

import os
import secrets
import socket

from specrouter.state.base import (
    AuditEntry,
    Lease,
    PolicyDoc,
    PolicyListener,
    PolicyRecord,
    ProbeReading,
    StateError,
    StateStore,
    StateUnavailable,
    VersionConflict,
)
from specrouter.state.memory import InMemoryStore
from specrouter.state.settings import StateSettings, redact_url


def default_replica_id() -> str:
    """Unique per process, readable in `redis-cli`: host, pid and a random suffix (a pid can
    be reused by a restarted pod, the suffix keeps the keys apart)."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:60]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


def make_store(settings: StateSettings, replica_id: str | None = None) -> StateStore:
    """InMemoryStore without a redis_url, RedisStore with one. Call `await store.start()`."""
    rid = replica_id or default_replica_id()
    if settings.redis_url is None:
        return InMemoryStore(rid, audit_cap=settings.audit_cap)
    from specrouter.state.redis_store import RedisStore

    return RedisStore(settings, rid)


__all__ = [
    "AuditEntry",
    "InMemoryStore",
    "Lease",
    "PolicyDoc",
    "PolicyListener",
    "PolicyRecord",
    "ProbeReading",
    "StateError",
    "StateSettings",
    "StateStore",
    "StateUnavailable",
    "VersionConflict",
    "default_replica_id",
    "make_store",
    "redact_url",
]
