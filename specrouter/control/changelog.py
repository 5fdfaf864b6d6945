"""The record of policy changes every holder keeps: a bounded history, the subscribers
called after each change, and one log line per change."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from specrouter.routing.policy import Policy

log = logging.getLogger(__name__)

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


class PolicyChangeLog:
    """History and subscribers of one holder.

    A listener that raises is logged and skipped: the others still run and the change
    stands. The history keeps the newest `size` changes.
    """

    def __init__(self, size: int = 100) -> None:
        self._history: deque[PolicyChange] = deque(maxlen=size)
        self._listeners: list[PolicyListener] = []

    @property
    def size(self) -> int:
        return self._history.maxlen or 0

    def history(self) -> list[PolicyChange]:
        """Newest first."""
        return list(reversed(self._history))

    def find(self, version: int) -> PolicyChange | None:
        """The change that put `version` in force, if the history holds it."""
        return next((c for c in reversed(self._history) if c.new.version == version), None)

    def replace(self, changes: Iterable[PolicyChange]) -> None:
        """Rebuild the history from `changes`, oldest first."""
        self._history.clear()
        self._history.extend(changes)

    def subscribe(self, listener: PolicyListener) -> Callable[[], None]:
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def record(self, change: PolicyChange, *, keep: bool = True) -> None:
        """Log `change`, add it to the history when `keep`, then call the listeners."""
        if keep:
            self._history.append(change)
        log.info("policy changed (%s by %s) to version %d at %s: old=%s new=%s", change.kind,
                 change.actor or "admin", change.new.version, change.at.isoformat(),
                 _compact(change.old), _compact(change.new))
        for listener in list(self._listeners):  # a listener may unsubscribe while called
            try:
                listener(change.old, change.new)
            except Exception:  # one bad listener must not undo an accepted change
                log.exception("policy listener %r failed", listener)


def _compact(policy: Policy) -> str:
    return policy.model_dump_json(exclude={"updated_at"})
