"""Recall: when a group switches to the baseline, its EAGLE-3 streams that have not sent
their first byte leave for the baseline too, as they would go if they arrived now.

The proxy holds each such stream's response until its first byte and watches the
target's recall event; once the first byte arrived, a later set is moot. Streams only:
a non-streamed answer arrives whole, so a queued request cannot be told from a long one.
"""

from __future__ import annotations

from specrouter.routing.router import HandoverBudget, RecallEvent, Target


class RecallRegistry:
    """The recall events of admitted, unreleased targets, per group."""

    def __init__(self) -> None:
        self._events: dict[str, dict[int, RecallEvent]] = {}

    def track(self, target: Target) -> None:
        if target.recall is not None:
            self._events.setdefault(target.group, {})[id(target)] = target.recall

    def forget(self, target: Target) -> None:
        if target.recall is not None:
            self._events.get(target.group, {}).pop(id(target), None)

    def recall_group(self, group: str, budget: float = 0.0) -> None:
        """Set the group's recall events; the streams past their first byte share one
        handover budget of `budget` context tokens."""
        shared = HandoverBudget(budget)
        for event in self._events.pop(group, {}).values():
            event.budget = shared
            event.set()
