"""Recall: when a group switches pools, its streams on the pool it left that have not
sent their first byte leave too, for where they would go if they arrived now; past
their first byte they are handed over (`proxy/handover.py`). The switch to the baseline
moves EAGLE-3 streams off a loaded GPU; the switch back moves baseline streams to
EAGLE-3, so a group returning to light load stops time-slicing its GPU between both
servers as soon as it can.

The proxy holds each such stream's response until its first byte and watches the
target's recall event; once the first byte arrived, a later set is moot. Streams only:
a non-streamed answer arrives whole, so a queued request cannot be told from a long one.
"""

from __future__ import annotations

from specrouter.backends import Pool
from specrouter.routing.router import HandoverBudget, RecallEvent, Target


class RecallRegistry:
    """The recall events of admitted, unreleased targets, per group and pool."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, Pool], dict[int, RecallEvent]] = {}

    def track(self, target: Target) -> None:
        if target.recall is not None:
            self._events.setdefault((target.group, target.pool), {})[id(target)] = target.recall

    def forget(self, target: Target) -> None:
        if target.recall is not None:
            self._events.get((target.group, target.pool), {}).pop(id(target), None)

    def recall_group(self, group: str, pool: Pool, budget: float = 0.0) -> None:
        """Set the recall events of the group's streams on `pool`; the streams past their
        first byte share one handover budget of `budget` context tokens."""
        shared = HandoverBudget(budget)
        for event in self._events.pop((group, pool), {}).values():
            event.budget = shared
            event.set()
