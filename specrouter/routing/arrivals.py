"""The arrival window: requests of a burst are decided together, not one by one.

A request that would go to EAGLE-3 waits until no other request arrived for `window_s`
(at most `max_wait_s`), and the requests arriving meanwhile count as load of its
decision; a burst still arriving at the cap counts as going on at the same rate for as
long again. Without it, the first request of a burst sees an idle group, goes to
EAGLE-3, and slows the baseline's batch on the shared GPU for its whole life. Nothing
waits when the request would go to the baseline anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: The routes whose requests are generations, the ones a burst is made of.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})


class ArrivalWindow:
    """Counts arrivals on one event loop; `pending` are requests still waiting."""

    def __init__(self, window_s: float, max_wait_s: float) -> None:
        self.window_s = window_s
        self.max_wait_s = max(window_s, max_wait_s)
        self.pending = 0
        self._arrivals = 0  # generation requests seen, ever
        self._last_arrival = float("-inf")  # event-loop time of the latest one

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    async def settle(self, worth_waiting: Callable[[], bool]) -> int:
        """Record an arrival and, when `worth_waiting()`, wait for a quiet window.
        Returns how many more requests of a burst still arriving at the cap the
        decision should expect (0 when the burst ended within the wait)."""
        loop = asyncio.get_running_loop()
        self._last_arrival = arrived = loop.time()
        self._arrivals += 1
        seen_before = self._arrivals
        if not worth_waiting():
            return 0
        self.pending += 1
        try:
            cap = arrived + self.max_wait_s
            while True:
                quiet_at = self._last_arrival + self.window_s
                now = loop.time()
                if now >= min(quiet_at, cap):
                    return self._arrivals - seen_before if quiet_at > cap else 0
                await asyncio.sleep(min(quiet_at, cap) - now)
        finally:
            self.pending -= 1
