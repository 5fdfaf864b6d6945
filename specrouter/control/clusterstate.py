"""The router on shared state: one policy and one load view for every replica (issue 5).

`ClusterState` joins a `StateStore` (specrouter.state) to the router:
- `StorePolicyHolder` is the `PolicyHolder` whose source of truth is the store. Every write
  is validated here (the store treats a policy as opaque JSON), then compare-and-set with
  the version it was merged onto, so two replicas PATCHing at once never lose an update: the
  loser re-merges its body onto the winner's policy and tries again. Changes made on other
  replicas arrive through `on_policy_change` and are validated too: a document another
  writer (or `redis-cli`) left invalid is logged and ignored, the old policy stays in force.
- the store's in-flight counts are what the router's load signal reads (`cluster_inflight`),
  and every admission holds a `Lease` until the proxy's `finally` releases it.
- `StateCollector` exports the store's health to Prometheus.

Redis being down never fails a request: reads are local; only an admin write needs Redis,
and it is answered 503 (OpenAI error format) with the old policy still in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from specrouter.control.holder import PolicyChange, PolicyListener, PolicyListeners, WriteKind
from specrouter.errors import RouterError
from specrouter.routing.policy import Policy, apply_patch, apply_put
from specrouter.state import (
    AuditEntry,
    PolicyRecord,
    StateSettings,
    StateStore,
    StateUnavailable,
    VersionConflict,
    make_store,
)
from specrouter.tasks import cancel_and_wait

log = logging.getLogger("specrouter.cluster")

#: Attempts of one admin write against concurrent writers before answering 409.
MAX_WRITE_ATTEMPTS = 8
#: How often the health watcher samples the store (counts degraded transitions).
WATCH_INTERVAL_S = 0.1
_SERVER_FIELDS = frozenset({"version"})


def policy_doc(policy: Policy) -> dict[str, Any]:
    """What is stored: the policy's JSON without `version` (the store numbers writes)."""
    return {k: v for k, v in policy.public().items() if k not in _SERVER_FIELDS}


def policy_from_record(record: PolicyRecord) -> Policy:
    """The router's Policy of a stored record; raises pydantic.ValidationError.

    Version 0 is the store's "held locally, never synced" record (Redis down at start):
    the router numbers it 1, as a fresh policy.
    """
    return Policy.model_validate({**record.doc, "version": max(1, record.version)})


class StorePolicyHolder:
    """`PolicyHolder` backed by a `StateStore`; see the module docstring."""

    def __init__(self, store: StateStore, initial: Policy, history_size: int = 100) -> None:
        self._store = store
        self._policy = initial
        self._history: deque[PolicyChange] = deque(maxlen=history_size)
        self._listeners = PolicyListeners()
        self._unsubscribe: Callable[[], None] | None = None
        self._pending: tuple[str, WriteKind] | None = None  # (actor, kind) of our own write
        self._audit_task: asyncio.Task[None] | None = None
        self._audit_stale = False  # a change arrived since the audit log was last read
        self.rejected = 0  # remote documents refused by validation (tests, debugging)
        self.conflicts = 0  # writes re-merged because another replica wrote first

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Adopt the shared policy, or seed it with ours (the store is already started)."""
        self._unsubscribe = self._store.on_policy_change(self._on_record)
        record = await self._store.ensure_policy(policy_doc(self._policy), actor="startup")
        self._on_record(record)
        self._refresh_history()

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._audit_task is not None:
            self._audit_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._audit_task

    # -- PolicyHolder ----------------------------------------------------------------------
    @property
    def current(self) -> Policy:
        return self._policy

    async def put(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        return await self._write(body, "put", actor)

    async def patch(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        return await self._write(body, "patch", actor)

    def history(self) -> list[PolicyChange]:
        return list(reversed(self._history))

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        return self._listeners.subscribe(listener)

    # -- writes ----------------------------------------------------------------------------
    async def _write(self, body: Mapping[str, Any], kind: WriteKind, actor: str) -> PolicyChange:
        apply = apply_put if kind == "put" else apply_patch
        for _ in range(MAX_WRITE_ATTEMPTS):
            base = self._policy
            new = apply(base, body)  # ValidationError -> 422, nothing written
            stored = self._store.get_policy()
            expected = 0 if stored is None else stored.version
            self._pending = (actor, kind)
            try:
                record = await self._store.put_policy(policy_doc(new), expected, actor)
            except VersionConflict as conflict:
                # Another replica won: merge our body onto its policy and try again.
                self.conflicts += 1
                if conflict.current is not None:
                    self._on_record(conflict.current)
                continue
            except StateUnavailable as exc:
                raise RouterError(
                    503, f"the shared state store is unavailable, the policy is unchanged "
                         f"(retry later): {exc}", code="state_unavailable") from None
            finally:
                self._pending = None
            self._on_record(record, kind, actor)  # no-op if the store's callback adopted it
            return self._change_for(record.version, base)
        raise RouterError(409, f"policy changed concurrently {MAX_WRITE_ATTEMPTS} times "
                               "while applying this write; retry", code="version_conflict")

    def _change_for(self, version: int, base: Policy) -> PolicyChange:
        for change in reversed(self._history):
            if change.new.version == version:
                return change
        return PolicyChange(base, self._policy, datetime.now(UTC), "put")

    # -- adoption (own writes, pub/sub, reconcile, startup) --------------------------------
    def _on_record(self, record: PolicyRecord, kind: WriteKind | None = None,
                   actor: str | None = None) -> None:
        try:
            new = policy_from_record(record)
        except (ValidationError, ValueError, TypeError) as exc:
            self.rejected += 1
            log.error("policy version %d from the state store is invalid, keeping version %d "
                      "in force: %s", record.version, self._policy.version,
                      _summary(exc))
            return
        old = self._policy
        if new.version < old.version or (new.version == old.version and new == old):
            return
        if kind is None:
            pending_actor, pending_kind = self._pending or (None, None)
            local = pending_actor is not None and record.updated_by == pending_actor
            kind = pending_kind if local and pending_kind else "put"
            actor = record.updated_by
        change = PolicyChange(old, new, datetime.now(UTC), kind, actor or "")
        self._policy = new
        if new.version == old.version + 1:
            # A change this replica saw replace its predecessor; with versions skipped (a
            # missed or reordered publish) `old` is not what the write replaced, and the
            # history waits for the cluster's audit log instead.
            self._history.append(change)
        log.info("policy version %d in force (%s by %s): %s", new.version, kind,
                 change.actor or "admin", new.model_dump_json(exclude={"updated_at"}))
        self._listeners.notify(old, new)
        self._refresh_history()

    def _refresh_history(self) -> None:
        """Rebuild the history from the cluster's audit log in the background (changes made
        while this replica was away are in it); a failure keeps the local history."""
        self._audit_stale = True
        if self._audit_task is not None and not self._audit_task.done():
            return  # the running load reads the log again before it ends
        with contextlib.suppress(RuntimeError):  # no running loop (sync tests)
            self._audit_task = asyncio.get_running_loop().create_task(self._load_audit())

    async def _load_audit(self) -> None:
        while self._audit_stale:
            self._audit_stale = False
            try:
                entries = await self._store.audit(self._history.maxlen or 100)
            except StateUnavailable:
                return
            changes = _changes_from_audit(entries)
            if changes and changes[-1].new.version >= self._policy.version:
                self._history.clear()
                self._history.extend(changes)


def _changes_from_audit(entries: Iterable[AuditEntry]) -> list[PolicyChange]:
    """Oldest-first PolicyChanges from newest-first audit entries (invalid ones skipped)."""
    policies: list[tuple[AuditEntry, Policy]] = []
    for entry in reversed(list(entries)):
        try:
            policies.append((entry, policy_from_record(
                PolicyRecord(entry.doc, entry.version, entry.updated_at, entry.updated_by))))
        except (ValidationError, ValueError, TypeError):
            continue
    changes: list[PolicyChange] = []
    for (_, old), (entry, new) in itertools.pairwise(policies):
        changes.append(PolicyChange(old, new, datetime.fromtimestamp(entry.updated_at, UTC),
                                    "put", entry.updated_by))
    return changes


def _summary(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'policy'}: {e['msg']}"
                         for e in exc.errors(include_url=False, include_input=False))
    return str(exc)[:300]


class ClusterState:
    """The store, the policy holder on it, and the health watcher: started and stopped with
    the router (`LoadAwareRouter.start/stop`)."""

    def __init__(self, store: StateStore, initial: Policy) -> None:
        self.store = store
        self.holder = StorePolicyHolder(store, initial)
        self.degraded_transitions = 0
        self._was_degraded = False
        self._watch: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: StateSettings, initial: Policy,
                      replica_id: str | None = None) -> ClusterState:
        return cls(make_store(settings, replica_id), initial)

    async def start(self) -> None:
        await self.store.start()  # never raises because Redis is down
        await self.holder.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_health())

    async def stop(self) -> None:
        if self._watch is not None:
            await cancel_and_wait([self._watch])
        await self.holder.stop()
        await self.store.close()

    def status(self) -> dict[str, Any]:
        status = self.store.status()
        status["degraded_transitions"] = self.degraded_transitions
        return status

    async def _watch_health(self) -> None:
        """Counts transitions into degraded for the metrics (the store logs them)."""
        while True:
            self._observe()
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _observe(self) -> None:
        degraded = bool(self.store.status().get("degraded"))
        if degraded and not self._was_degraded:
            self.degraded_transitions += 1
        self._was_degraded = degraded


class StateCollector(Collector):
    """specrouter_state_* series, read from the store at scrape time."""

    def __init__(self, state: ClusterState, clock: Callable[[], float] = time.monotonic) -> None:
        self._state = state
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        self._state._observe()  # a transition between two watcher ticks still counts
        status = self._state.status()
        backend = str(status.get("backend", "memory"))
        connected = GaugeMetricFamily("specrouter_state_connected",
                                      "1 if the state store is reachable", labels=["backend"])
        connected.add_metric([backend], 1.0 if status.get("connected") else 0.0)
        degraded = GaugeMetricFamily("specrouter_state_degraded",
                                     "1 while the router serves on its local view only",
                                     labels=["backend"])
        degraded.add_metric([backend], 1.0 if status.get("degraded") else 0.0)
        age = GaugeMetricFamily("specrouter_state_last_sync_age_seconds",
                                "Age of the cluster view of other replicas' counts")
        if status.get("last_sync_age_s") is not None:
            age.add_metric([], float(status["last_sync_age_s"]))
        replicas = GaugeMetricFamily("specrouter_state_replicas_seen",
                                     "Router replicas in the last cluster view")
        replicas.add_metric([], float(status.get("replicas_seen") or 0))
        transitions = CounterMetricFamily("specrouter_state_degraded_transitions",
                                          "Times the state store became unreachable")
        transitions.add_metric([], float(self._state.degraded_transitions))
        cluster = GaugeMetricFamily("specrouter_cluster_inflight_requests",
                                    "Requests in flight per backend over all replicas "
                                    "(this replica's view)", labels=["backend"])
        for name, count in sorted(self._state.store.cluster_inflight().items()):
            cluster.add_metric([name], float(count))
        yield from (connected, degraded, age, replicas, transitions, cluster)
