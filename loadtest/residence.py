"""Each request's real time inside the simulated engines before its first token.

The simulator runs `1 / time_scale` times faster than a GPU; dividing a client's whole
time to the first token by the time scale also divides the real milliseconds spent outside
the engines (a router's request path, the HTTP hops), which a GPU deployment pays at their
real size: a proxy's millisecond would count as 1 / time_scale simulated ones. The
engines record each request's stays by its `x-request-id` (`specrouter.sim.residence`,
GET /sim/residence); the part of them between the client's send and its first token is
the engine's time (`RequestResult.engine_s`), and `RequestResult.deployed_ttft` converts
only that part. A request retried or recalled to another engine sums its stays in each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from loadtest import loopback
from loadtest.metrics import RequestResult

Stay = Sequence[float | None]  # [submitted, first token or None, left or None]


def fetch_stays(urls: Iterable[str]) -> dict[str, list[Stay]]:
    """Every engine's stays, by request id."""
    stays: dict[str, list[Stay]] = {}
    for url in urls:
        answer = loopback.get(f"{url}/sim/residence", timeout=10.0)
        answer.raise_for_status()
        for rid, kept in answer.json()["stays"].items():
            stays.setdefault(rid, []).extend(kept)
    return stays


def engine_seconds(stays: Sequence[Stay], sent_at: float, ttft: float) -> float:
    """The time of `stays` within [sent_at, sent_at + ttft]: a stay ends at its first
    token, or where it left, or (still open) at the client's first token."""
    first = sent_at + ttft
    total = 0.0
    for submitted, first_token, left in stays:
        assert submitted is not None
        end = first_token if first_token is not None else left if left is not None else first
        total += max(0.0, min(end, first) - max(submitted, sent_at))
    return min(total, ttft)


def attach_engine_time(results: Iterable[RequestResult],
                       stays: Mapping[str, Sequence[Stay]]) -> None:
    """Set `engine_s` of every answered request whose id some engine kept."""
    for r in results:
        kept = stays.get(r.request_id)
        if kept and r.ttft is not None and r.sent_at is not None:
            r.engine_s = engine_seconds(kept, r.sent_at, r.ttft)
