"""What was routed where: an approximate, per-backend index of prompt prefixes, and the
backend each client session last went to.

Like the SGLang model gateway's approximate radix tree (`--policy cache_aware`), the
index records what the router sent, not what the engine holds. Each backend's index is
bounded by that server's KV pool in tokens and evicts least recently used blocks, the
longest prefixes first, as SGLang's radix cache evicts unreferenced leaves first; so the
blocks kept for a backend are, to a good approximation, what its cache still holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specrouter.routing.affinity.keys import PrefixKeys


class PrefixIndex:
    """The block keys routed to one backend, at most `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a prefix index holds at least one block")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def resize(self, capacity: int) -> None:
        """A new bound (the server's KV pool as its telemetry reports it)."""
        self.capacity = max(1, capacity)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` (one prompt's key chain) the index holds.

        A binary search: it relies on the chain's shape, where a block is held only with
        the blocks before it (they are inserted together and evicted after it), so it
        costs O(log n) set lookups instead of one per matched block."""
        blocks = self._blocks
        if not keys or keys[0] not in blocks:
            return 0
        if keys[-1] in blocks:
            return len(keys)
        lo, hi = 1, len(keys) - 1  # keys[lo - 1] is held, keys[hi] is not
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in blocks:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, keys: tuple[int, ...]) -> None:
        """Record a prompt routed here: its blocks become the most recently used, the
        shortest prefixes most of all (they are evicted last)."""
        blocks = self._blocks
        for key in reversed(keys[:self.capacity]):
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class SessionTable:
    """Session key -> (the backend its last request went to, that prompt's tokens, when),
    at most `capacity` sessions, least recently seen dropped first; and per backend the
    live footprint: the tokens of the sessions with a request in flight there or whose
    last request there ended within the last `live_s` seconds (their prefixes are what
    the server's cache must keep: an agent's next turn follows its answer, which at tens
    of milliseconds a token may take longer than `live_s` to stream)."""

    def __init__(self, capacity: int, live_s: float = 30.0) -> None:
        self.capacity = capacity
        self.live_s = live_s
        self._sessions: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self._live: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self._footprint: dict[str, float] = {}
        self._inflight: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session: str) -> tuple[str, float] | None:
        seen = self._sessions.get(session)
        return None if seen is None else (seen[0], seen[1])

    def put(self, session: str, backend: str, tokens: float, now: float = 0.0) -> None:
        self._drop_live(session)
        entry = (backend, tokens, now)
        self._sessions[session] = entry
        self._sessions.move_to_end(session)
        self._live[session] = entry
        self._footprint[backend] = self._footprint.get(backend, 0.0) + tokens
        while len(self._sessions) > self.capacity:
            gone, _ = self._sessions.popitem(last=False)
            self._drop_live(gone)

    def begin(self, session: str) -> None:
        """A request of `session` is in flight: it stays live until `end` and `live_s`."""
        self._inflight[session] = self._inflight.get(session, 0) + 1

    def end(self, session: str, now: float) -> None:
        """A request of `session` ended: its live time counts from `now`."""
        left = self._inflight.get(session, 0) - 1
        if left > 0:
            self._inflight[session] = left
        else:
            self._inflight.pop(session, None)
        self._refresh(session, now)

    def _refresh(self, session: str, now: float) -> None:
        entry = self._live.get(session)
        if entry is not None:
            self._live[session] = (entry[0], entry[1], max(entry[2], now))
            self._live.move_to_end(session)

    def footprint(self, now: float, without: str | None = None) -> dict[str, float]:
        """Per backend the tokens of its live sessions, less session `without`'s own."""
        while self._live:
            oldest = next(iter(self._live))
            if now - self._live[oldest][2] <= self.live_s:
                break
            if oldest in self._inflight:
                self._refresh(oldest, now)
                continue
            self._drop_live(oldest)
        out = dict(self._footprint)
        own = self._live.get(without) if without is not None else None
        if own is not None:
            out[own[0]] -= own[1]
        return out

    def _drop_live(self, session: str) -> None:
        entry = self._live.pop(session, None)
        if entry is not None:
            self._footprint[entry[0]] -= entry[1]


def matched_tokens(index: PrefixIndex, prefix: PrefixKeys) -> float:
    """Estimated prompt tokens `index` holds of `prefix`."""
    return prefix.tokens(index.match(prefix.keys))
