"""Whether each backend's answers meet the operator's time-per-output-token objective, as
the router relays them (`affinity.tpot_slo_ms`).

A streamed answer's time per output token is the time from its first chunk to its end
over its tokens after the first (the engine's `usage.completion_tokens`), in the router's
clock: it holds everything a client sees between tokens, the decode steps, the prefill
batches run between them and the sibling server's steps on the shared GPU, which a cost
model of decode steps leaves out. A backend meets the objective while at least
`MET_SHARE` of its last `RECENT_ANSWERS` answers (and no fewer than `MIN_ANSWERS`) were
within it: a pool whose answers meet it gains nothing from a faster pool, so a group
switch that would re-prefill its live sessions buys nothing (`pricing.keep_group_pool`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

#: The answers a backend is judged by: the latest ones, so that a load that grows shows
#: within a few answers.
RECENT_ANSWERS = 16
#: Fewer answers than this say nothing yet.
MIN_ANSWERS = 4
#: The share of recent answers within the objective for a backend to meet it.
MET_SHARE = 0.9


class TpotObjective:
    """The recent answers' time per output token of every backend, against `slo_ms`."""

    def __init__(self, backends: Iterable[str], slo_ms: float) -> None:
        self.slo_ms = slo_ms
        self._recent: dict[str, deque[float]] = {
            b: deque(maxlen=RECENT_ANSWERS) for b in backends}
        self._meeting: frozenset[str] = frozenset()

    def observe(self, backend: str, tpot_ms: float) -> None:
        recent = self._recent.get(backend)
        if recent is None or tpot_ms < 0:
            return
        recent.append(tpot_ms)
        if self._judge(recent) != (backend in self._meeting):
            self._meeting = self._meeting ^ {backend}

    def meeting(self) -> frozenset[str]:
        """The backends that meet the objective now."""
        return self._meeting

    def within_shares(self) -> dict[str, float]:
        """Per backend with answers, the share of its recent ones within the objective."""
        return {b: self._within(r) / len(r) for b, r in self._recent.items() if r}

    def report(self) -> dict[str, dict[str, float | int | bool]]:
        """Per backend, for GET /policy: answers judged, the share within, whether met."""
        shares = self.within_shares()
        return {backend: {"answers": len(recent),
                          "within_share": round(shares.get(backend, 0.0), 3),
                          "meets": backend in self._meeting}
                for backend, recent in self._recent.items()}

    def _within(self, recent: deque[float]) -> int:
        return sum(1 for t in recent if t <= self.slo_ms)

    def _judge(self, recent: deque[float]) -> bool:
        return len(recent) >= MIN_ANSWERS and self._within(recent) >= MET_SHARE * len(recent)
