"""`StorePolicyHolder`: the `PolicyHolder` whose source of truth is the shared `StateStore`.

Every write is validated here (the store treats a policy as opaque JSON), then
compare-and-set with the version it was merged onto, so two replicas writing at once never
lose an update: the loser merges its body onto the winner's policy and tries again, after a
jittered backoff, until `WRITE_DEADLINE_S` has passed (then 409). Writes inside one replica
take turns (a lock), so they never conflict with each other: only writes of other replicas
can make a write retry.
Changes made on other replicas arrive through `on_policy_change` and are validated too: a
document another writer left invalid is logged and ignored, the old policy stays in force.
Only a write needs the store: while it is unreachable, writes are answered 503 and the
policy in force is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from specrouter.control.changelog import PolicyChange, PolicyChangeLog, PolicyListener, WriteKind
from specrouter.errors import RouterError, describe_validation_error
from specrouter.routing.policy import Policy, apply_patch, apply_put
from specrouter.state import AuditEntry, PolicyRecord, StateStore, StateUnavailable, VersionConflict

log = logging.getLogger(__name__)

#: How long one admin write may keep retrying against other replicas' writes before 409.
WRITE_DEADLINE_S = 5.0
#: Backoff between attempts: doubled each time up to the maximum, with full jitter, so
#: replicas that collided do not collide again in step.
RETRY_BACKOFF_S = 0.005
RETRY_BACKOFF_MAX_S = 0.2
_SERVER_FIELDS = frozenset({"version"})


def policy_doc(policy: Policy) -> dict[str, Any]:
    """What is stored: the policy's JSON without `version` (the store numbers writes)."""
    return {k: v for k, v in policy.public().items() if k not in _SERVER_FIELDS}


def policy_from_record(record: PolicyRecord) -> Policy:
    """The router's Policy of a stored record; raises pydantic.ValidationError.

    Version 0 is the store's "held locally, never synced" record: the router numbers it 1,
    as a fresh policy.
    """
    return Policy.model_validate({**record.doc, "version": max(1, record.version)})


class StorePolicyHolder:
    """`PolicyHolder` backed by a `StateStore`; see the module docstring."""

    def __init__(self, store: StateStore, initial: Policy, history_size: int = 100) -> None:
        self._store = store
        self._policy = initial
        self._changes = PolicyChangeLog(history_size)
        self._unsubscribe: Callable[[], None] | None = None
        self._pending: tuple[str, WriteKind] | None = None  # (actor, kind) of our own write
        self._audit_task: asyncio.Task[None] | None = None
        self._audit_stale = False  # a change arrived since the audit log was last read
        self._write_lock = asyncio.Lock()  # one write of this replica at a time

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
        return self._changes.history()

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        return self._changes.subscribe(listener)

    # -- writes ----------------------------------------------------------------------------
    async def _write(self, body: Mapping[str, Any], kind: WriteKind, actor: str) -> PolicyChange:
        deadline = time.monotonic() + WRITE_DEADLINE_S
        async with self._write_lock:
            backoff = RETRY_BACKOFF_S
            attempts = 0
            while True:
                attempts += 1
                change = await self._try_write(body, kind, actor)
                if change is not None:
                    return change
                pause = random.uniform(0, backoff)
                if time.monotonic() + pause > deadline:
                    break
                await asyncio.sleep(pause)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
        raise RouterError(409, f"the policy changed concurrently on other replicas {attempts} "
                               f"times in {WRITE_DEADLINE_S:g} s while applying this write; "
                               "retry", code="version_conflict")

    async def _try_write(self, body: Mapping[str, Any], kind: WriteKind,
                         actor: str) -> PolicyChange | None:
        """One compare-and-set; None when another replica's write came first (its policy is
        then in force here, for the next attempt to merge onto)."""
        apply = apply_put if kind == "put" else apply_patch
        base = self._policy
        new = apply(base, body)  # ValidationError -> 422, nothing written
        stored = self._store.get_policy()
        expected = 0 if stored is None else stored.version
        self._pending = (actor, kind)
        try:
            record = await self._store.put_policy(policy_doc(new), expected, actor)
        except VersionConflict as conflict:
            if conflict.current is not None:
                self._on_record(conflict.current)
            return None
        except StateUnavailable as exc:
            raise RouterError(
                503, f"the shared state store is unavailable, the policy is unchanged "
                     f"(retry later): {exc}", code="state_unavailable") from None
        finally:
            self._pending = None
        self._on_record(record, kind, actor)  # no-op if the store's callback adopted it
        # What this write stored, even when a later write of another replica is already
        # in force here (its publish can overtake our reply).
        written = new.model_copy(update={"version": record.version})
        return (self._changes.find(record.version)
                or PolicyChange(base, written, datetime.now(UTC), kind, actor))

    # -- adoption (own writes, pub/sub, reconcile, startup) --------------------------------
    def _on_record(self, record: PolicyRecord, kind: WriteKind | None = None,
                   actor: str | None = None) -> None:
        try:
            new = policy_from_record(record)
        except ValidationError as exc:
            self._reject(record, describe_validation_error(exc, subject="policy"))
            return
        except (ValueError, TypeError) as exc:
            self._reject(record, str(exc)[:300])
            return
        old = self._policy
        if new.version < old.version or (new.version == old.version and new == old):
            return
        if kind is None:
            pending_actor, pending_kind = self._pending or (None, None)
            local = pending_actor is not None and record.updated_by == pending_actor
            kind = pending_kind if local and pending_kind else "put"
            actor = record.updated_by
        self._policy = new
        # Only a change seen replacing its predecessor enters the history: with versions
        # skipped (a missed or reordered publish) `old` is not what the write replaced, and
        # the history waits for the cluster's audit log instead.
        self._changes.record(PolicyChange(old, new, datetime.now(UTC), kind, actor or ""),
                             keep=new.version == old.version + 1)
        self._refresh_history()

    def _reject(self, record: PolicyRecord, problem: str) -> None:
        log.error("policy version %d from the state store is invalid, keeping version %d "
                  "in force: %s", record.version, self._policy.version, problem)

    def _refresh_history(self) -> None:
        """Rebuild the history from the cluster's audit log in the background (it holds the
        changes made while this replica was away); a failure keeps the local history."""
        self._audit_stale = True
        if self._audit_task is not None and not self._audit_task.done():
            return  # the running load reads the log again before it ends
        with contextlib.suppress(RuntimeError):  # no running loop (sync tests)
            self._audit_task = asyncio.get_running_loop().create_task(self._load_audit())

    async def _load_audit(self) -> None:
        while self._audit_stale:
            self._audit_stale = False
            try:
                entries = await self._store.audit(self._changes.size)
            except StateUnavailable:
                return
            changes = changes_from_audit(entries)
            if changes and changes[-1].new.version >= self._policy.version:
                self._changes.replace(changes)


def changes_from_audit(entries: Iterable[AuditEntry]) -> list[PolicyChange]:
    """Oldest-first PolicyChanges from newest-first audit entries (invalid ones skipped)."""
    policies: list[tuple[AuditEntry, Policy]] = []
    for entry in reversed(list(entries)):
        try:
            policies.append((entry, policy_from_record(
                PolicyRecord(entry.doc, entry.version, entry.updated_at, entry.updated_by))))
        except (ValidationError, ValueError, TypeError):
            continue
    return [PolicyChange(old, new, datetime.fromtimestamp(entry.updated_at, UTC), "put",
                         entry.updated_by)
            for (_, old), (entry, new) in itertools.pairwise(policies)]
