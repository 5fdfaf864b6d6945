"""The arrival window: requests of a burst are decided together, not one by one.

A request that would go to EAGLE-3 waits until no other request arrived for `window_s`
(at most `max_wait_s`), and the requests arriving meanwhile count as load of its
decision; a burst still arriving at the cap counts as going on at the same rate for as
long again. Without it, the first request of a burst sees an idle group, goes to
EAGLE-3, and slows the baseline's batch on the shared GPU for its whole life. Nothing
waits when the request would go to the baseline anyway.

Nor when no plausible burst could change the decision: `plausible_burst` is what the
window could count, judged by the recent arrivals: twice the most arrivals seen within
one `max_wait_s` span over the last one to two `memory_s` (a burst still arriving at the
cap counts twice), at least two. A router younger than `memory_s` judges by what it has
seen since its start, as an older one does by its last periods: a light load waits for
nothing from its first request, and a burst becomes plausible while it arrives (its
first requests may go to EAGLE-3; the recall takes back the streams among them that have
not answered when the group switches).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: The routes whose requests are generations, the ones a burst is made of.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request that arrived (`at`, monotonic time, the `seen`-th ever) and waits."""

    at: float
    seen: int


class ArrivalWindow:
    """Counts arrivals on one event loop, in `time.monotonic` seconds; `pending` are
    requests still waiting."""

    def __init__(self, window_s: float, max_wait_s: float, memory_s: float = 60.0) -> None:
        self.window_s = window_s
        self.max_wait_s = max(window_s, max_wait_s)
        self.memory_s = memory_s
        self.pending = 0
        self._arrivals = 0  # generation requests seen, ever
        self._last_arrival = float("-inf")  # when the latest one arrived
        self._recent: deque[float] = deque()  # arrival times of the last max_wait_s
        self._peak = 0  # most arrivals within one max_wait_s span, this memory period
        self._peak_before = 0  # the same, the period before (0 in the first period)
        self._period_end: float | None = None

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def plausible_burst(self) -> int:
        """The most requests a burst may still bring within one wait (module docstring)."""
        return 2 * max(1, self._peak, self._peak_before)

    def _record(self, now: float) -> None:
        self._last_arrival = now
        self._arrivals += 1
        if self._period_end is None:
            self._period_end = now + self.memory_s
        elif now >= self._period_end:
            quiet = now >= self._period_end + self.memory_s  # a whole period without arrivals
            self._peak_before = 0 if quiet else self._peak
            self._peak, self._period_end = 0, now + self.memory_s
        recent = self._recent
        recent.append(now)
        while recent[0] <= now - self.max_wait_s:
            recent.popleft()
        self._peak = max(self._peak, len(recent))

    def arrive(self, worth_waiting: Callable[[], bool]) -> Arrival | None:
        """Record an arrival; when `worth_waiting()`, the arrival to `wait` for a quiet
        window from (None: no wait)."""
        arrived = time.monotonic()
        self._record(arrived)
        return Arrival(arrived, self._arrivals) if worth_waiting() else None

    async def settle(self, worth_waiting: Callable[[], bool]) -> int:
        """`arrive`, then `wait` if it is worth waiting (0 if not)."""
        arrival = self.arrive(worth_waiting)
        return 0 if arrival is None else await self.wait(arrival)

    async def wait(self, arrival: Arrival) -> int:
        """Wait for a quiet window after `arrival`. Returns how many more requests of a
        burst still arriving at the cap the decision should expect (0 when the burst
        ended within the wait)."""
        self.pending += 1
        try:
            cap = arrival.at + self.max_wait_s
            while True:
                quiet_at = self._last_arrival + self.window_s
                now = time.monotonic()
                if now >= min(quiet_at, cap):
                    return self._arrivals - arrival.seen if quiet_at > cap else 0
                await asyncio.sleep(min(quiet_at, cap) - now)
        finally:
            self.pending -= 1
