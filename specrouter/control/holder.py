"""Where the policy in force lives: read by every request, written by the admin API.

The router and `/policy` never hold a `Policy` themselves; they ask a `PolicyHolder`.
Reading is a plain attribute access (the request path), writing is `async` (an admin
call), so a holder backed by the cluster store (issue 5: compare-and-set in Redis,
pub/sub to the other replicas) can replace `LocalPolicyHolder` without touching the
router or the admin routes.

Every accepted change is logged with the old and the new policy and when it happened,
and kept in a small in-memory history.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from specrouter.routing.policy import Policy, apply_patch, apply_put

log = logging.getLogger("specrouter.routing.policy")

WriteKind = Literal["put", "patch"]
PolicyListener = Callable[[Policy, Policy], None]


@dataclass(frozen=True)
class PolicyChange:
    """One accepted write: what was in force before, what is now, when and how."""

    old: Policy
    new: Policy
    at: datetime
    kind: WriteKind
    actor: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.at.isoformat(), "kind": self.kind, "actor": self.actor,
                "old": self.old.public(), "new": self.new.public()}


class PolicyHolder(Protocol):
    """The policy in force. `current` must be cheap: it is read once per request."""

    @property
    def current(self) -> Policy: ...

    async def put(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        """Replace the policy; raises pydantic.ValidationError and keeps the old one."""

    async def patch(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        """Merge `body` into the policy; raises pydantic.ValidationError likewise."""

    def history(self) -> list[PolicyChange]:
        """Recent changes, newest first."""

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        """Call `listener(old, new)` after each change; returns an unsubscribe function."""


class PolicyListeners:
    """The subscribers of one holder, called after each accepted change.

    Shared by every `PolicyHolder` so that all of them give the same guarantee: a listener
    that raises is logged and skipped, the others still run and the change stands.
    """

    def __init__(self) -> None:
        self._listeners: list[PolicyListener] = []

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def notify(self, old: Policy, new: Policy) -> None:
        for listener in list(self._listeners):  # a listener may unsubscribe while called
            try:
                listener(old, new)
            except Exception:  # one bad listener must not undo an accepted change
                log.exception("policy listener %r failed", listener)


class LocalPolicyHolder:
    """The embedded holder: one process, the policy in memory."""

    def __init__(self, initial: Policy, history_size: int = 100) -> None:
        self._policy = initial
        self._history: deque[PolicyChange] = deque(maxlen=history_size)
        self._listeners = PolicyListeners()

    @property
    def current(self) -> Policy:
        return self._policy

    async def put(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        return self._commit(apply_put(self._policy, body), "put", actor)

    async def patch(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        return self._commit(apply_patch(self._policy, body), "patch", actor)

    def history(self) -> list[PolicyChange]:
        return list(reversed(self._history))

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        return self._listeners.subscribe(listener)

    def _commit(self, new: Policy, kind: WriteKind, actor: str) -> PolicyChange:
        change = PolicyChange(self._policy, new, datetime.now(UTC), kind, actor)
        self._policy = new
        self._history.append(change)
        log.info("policy changed (%s by %s) at %s: old=%s new=%s", kind, actor or "admin",
                 change.at.isoformat(), _compact(change.old), _compact(change.new))
        self._listeners.notify(change.old, change.new)
        return change


def _compact(policy: Policy) -> str:
    return policy.model_dump_json(exclude={"updated_at"})
