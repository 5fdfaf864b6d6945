"""Where the policy in force lives: read by every request, written by the admin API.

The router and `/policy` never hold a `Policy` themselves; they ask a `PolicyHolder`.
Reading is a plain attribute access (the request path), writing is `async` (an admin
call), so the holder on the cluster store (`storeholder.StorePolicyHolder`) replaces
`LocalPolicyHolder` without touching the router or the admin routes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from specrouter.control.changelog import PolicyChange, PolicyChangeLog, PolicyListener, WriteKind
from specrouter.routing.policy import Policy, apply_patch, apply_put


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


class LocalPolicyHolder:
    """The embedded holder: one process, the policy in memory."""

    def __init__(self, initial: Policy, history_size: int = 100) -> None:
        self._policy = initial
        self._changes = PolicyChangeLog(history_size)

    @property
    def current(self) -> Policy:
        return self._policy

    async def put(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        return self._commit(apply_put(self._policy, body), "put", actor)

    async def patch(self, body: Mapping[str, Any], actor: str = "") -> PolicyChange:
        return self._commit(apply_patch(self._policy, body), "patch", actor)

    def history(self) -> list[PolicyChange]:
        return self._changes.history()

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        return self._changes.subscribe(listener)

    def _commit(self, new: Policy, kind: WriteKind, actor: str) -> PolicyChange:
        change = PolicyChange(self._policy, new, datetime.now(UTC), kind, actor)
        self._policy = new
        self._changes.record(change)
        return change
