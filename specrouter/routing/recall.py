"""Recall: when a group switches to the baseline, its EAGLE-3 streams that have not sent
their first byte leave for the baseline too, as they would go if they arrived now.

The proxy holds each such stream's response until its first byte and watches the
target's recall event; once the first byte arrived, a later set is moot. Streams only:
a non-streamed answer arrives whole, so a queued request cannot be told from a long one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from specrouter.routing.router import Target


class RecallEvent(asyncio.Event):
    """An `asyncio.Event` that also runs callbacks, synchronously, when first set: a
    recall cancels the attempt's work from its callback, so waiting for the work or the
    recall takes no second task and no `asyncio.wait`."""

    def __init__(self) -> None:
        super().__init__()
        self._on_set: list[Callable[[], object]] = []

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        callbacks, self._on_set = self._on_set, []
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], object]) -> None:
        self._on_set.append(callback)

    def discard(self, callback: Callable[[], object]) -> None:
        with contextlib.suppress(ValueError):
            self._on_set.remove(callback)


class RecallRegistry:
    """The recall events of admitted, unreleased targets, per group."""

    def __init__(self) -> None:
        self._events: dict[str, dict[int, asyncio.Event]] = {}

    def track(self, target: Target) -> None:
        if target.recall is not None:
            self._events.setdefault(target.group, {})[id(target)] = target.recall

    def forget(self, target: Target) -> None:
        if target.recall is not None:
            self._events.get(target.group, {}).pop(id(target), None)

    def recall_group(self, group: str) -> None:
        for event in self._events.pop(group, {}).values():
            event.set()
