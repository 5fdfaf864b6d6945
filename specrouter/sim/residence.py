"""How long each client request stayed in this engine before its first token, in real time.

The simulator runs `1 / time_scale` times faster than a GPU, so a benchmark that converts
a client's whole time to the first token into simulated seconds also multiplies the real
milliseconds spent outside the engine (a proxy's request path, the HTTP hops) by
`1 / time_scale`. With each request's stay in the engine known, the client's time splits
into the engine's part, which converts, and the rest, which stays real
(`loadtest.residence`).

A stay runs from the request's submission to the scheduler (after its body was read and
parsed: SGLang's tokenizer works in real time too) to its first output token reaching the
HTTP handler, or to its end without one (aborted, refused, its client gone). Stays are
kept by the request's `x-request-id` header (a router forwards the client's), the last
`capacity` ids only, and read at GET /sim/residence; a request without the header keeps
none. Times are `time.perf_counter()`: CLOCK_MONOTONIC on Linux, the clock a load
generator on the same host reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: Request ids whose stays are kept (the oldest are dropped first).
CAPACITY = 50_000


@dataclass
class Stay:
    submitted: float
    first_token: float | None = None
    left: float | None = None  # ended without a first token

    def saw_first_token(self) -> None:
        if self.first_token is None and self.left is None:
            self.first_token = time.perf_counter()

    def leave(self) -> None:
        if self.first_token is None and self.left is None:
            self.left = time.perf_counter()

    def as_list(self) -> list[float | None]:
        return [self.submitted, self.first_token, self.left]


class Residences:
    """The stays of the last `capacity` request ids seen, each id's in arrival order."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._stays: OrderedDict[str, list[Stay]] = OrderedDict()

    def begin(self, request_id: str | None) -> Stay:
        """A stay starting now; kept under `request_id` unless that is None."""
        stay = Stay(time.perf_counter())
        if request_id:
            kept = self._stays.get(request_id)
            if kept is None:
                kept = self._stays[request_id] = []
                if len(self._stays) > self.capacity:
                    self._stays.popitem(last=False)
            kept.append(stay)
        return stay

    def as_json(self) -> dict[str, Any]:
        return {"clock": "perf_counter",
                "stays": {rid: [s.as_list() for s in stays]
                          for rid, stays in self._stays.items()}}
