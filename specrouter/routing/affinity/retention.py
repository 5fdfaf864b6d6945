"""How much of what the index predicts each backend's cache still holds: the engines'
reported cached tokens against the index's prediction.

The index records what the router sent, not what the engine kept: a radix cache smaller
than the sessions cycling through it evicts each before its next turn, and the index,
bounded by the same pool but blind to what the engine evicts for running requests'
KV, still predicts it. SGLang reports per request what it found cached
(`usage.prompt_tokens_details.cached_tokens` with `--enable-cache-report`,
`meta_info.cached_tokens` on /generate). Per backend the retention is an exponentially
weighted mean, over the requests for which the index predicted at least one block, of
(reported cached share) / (predicted cached share), at most 1: shares, so the router's
bytes-per-token estimate cancels. The index's prediction for a backend is scaled by it.
A session whose turn came back with less than `lost_below` of its prediction cached has
no credit on that backend until one of its turns there comes back cached: the engine
evicted it. With `applied` off (the default, `affinity.retention_applied`) the retention
is measured and shown only, and the index's prediction counts whole: applied, it lost
goodput on the agentic bench (docs/policy.md section 9). Either way a backend's
retention over `MIN_SAMPLES` reports or more is `measured`: the group-switch guard
(`pricing.keep_group_pool`) and the move off an evicting pool
(`pricing.leave_evicting_pool`) read it to tell a server that evicts its sessions. A
group's move onto a pool has its servers measured anew (`remeasure`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

#: Reports a backend's retention rests on before it counts as measured: at weight 0.2 a
#: retention of 1 falls below 0.5 only after four uncached reports in a row.
MIN_SAMPLES = 5


class Retention:
    """Per backend the retention (1 until observed) and the sessions that lost their
    credit, at most `max_sessions`, the oldest forgotten first."""

    def __init__(self, backends: Iterable[str], max_sessions: int, weight: float = 0.2,
                 lost_below: float = 0.5, applied: bool = False) -> None:
        self.applied = applied
        self._share = {b: 1.0 for b in backends}
        self._samples = dict.fromkeys(self._share, 0)
        self._weight = weight
        self._lost_below = lost_below
        self._max_sessions = max_sessions
        self._lost: OrderedDict[str, str] = OrderedDict()
        self.measured: dict[str, float] = {}  # backends with MIN_SAMPLES reports or more

    def share(self, backend: str) -> float:
        """The share of the index's prediction for `backend` to count: what its cache
        held, or 1 where the retention is measured only (`applied` off)."""
        return self._share.get(backend, 1.0) if self.applied else 1.0

    def lost(self, session: str, backend: str) -> bool:
        """Whether `session`'s last turn on `backend` came back uncached (and counts)."""
        return self.applied and self._lost.get(session) == backend

    def observe(self, backend: str, session: str | None, predicted_share: float,
                prompt: int, cached: int, block_tokens: float) -> None:
        """One request's report: `cached` of `prompt` tokens, where the index predicted
        `predicted_share` of the prompt. A prediction of less than one block says nothing
        of the cache and is not counted."""
        if (backend not in self._share or prompt <= 0
                or predicted_share * prompt < block_tokens):
            return
        expected = min(1.0, predicted_share)
        sample = min(1.0, max(0, cached) / prompt / expected)
        self._share[backend] += self._weight * (sample - self._share[backend])
        self._samples[backend] += 1
        if self._samples[backend] >= MIN_SAMPLES:
            self.measured[backend] = self._share[backend]
        if session is None:
            return
        if sample < self._lost_below:
            self._lost[session] = backend
            self._lost.move_to_end(session)
            while len(self._lost) > self._max_sessions:
                self._lost.popitem(last=False)
        elif self._lost.get(session) == backend:
            del self._lost[session]

    def remeasure(self, backend: str) -> None:
        """Measure `backend` anew from its next reports (the group moved onto it: its cache
        now holds what the group left there, not what it held when it last reported)."""
        if backend in self._share:
            self._share[backend], self._samples[backend] = 1.0, 0
            self.measured.pop(backend, None)

    def stats(self) -> dict[str, Any]:
        """For GET /policy: per backend the retention and the reports it rests on."""
        return {b: {"share": round(s, 4), "samples": self._samples[b],
                    "applied": self.applied} for b, s in self._share.items()}

    def shares(self) -> dict[str, float]:
        return dict(self._share)
