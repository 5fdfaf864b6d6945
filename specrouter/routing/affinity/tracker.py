"""The router's affinity state: one prefix index per backend, the session table and the
counts GET /policy and /metrics show. Runs on the router's event loop; not thread-safe.

What holds across router replicas: each replica indexes only what it routed itself, so
a request is matched only by the replica that saw its earlier turns. With
`session_home`, sessions that send a session key land in the same group from every
replica (its home group, by rendezvous hashing over the groups) unless load moves them.
The engines' caches are shared by all replicas, so a replica that does not know a prefix
costs at most one miss per session before it learns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specrouter.config import AffinitySettings
from specrouter.observe.loadview import GroupView
from specrouter.routing.affinity.index import PrefixIndex, SessionTable
from specrouter.routing.affinity.keys import PrefixKeys, home_group
from specrouter.routing.affinity.objective import TpotObjective
from specrouter.routing.affinity.pricing import AffinityPrices, GroupAffinity
from specrouter.routing.affinity.retention import Retention


@dataclass(frozen=True, slots=True)
class Lookup:
    """One request's affinity: per backend the prompt tokens it is believed to hold, and
    the backend the client's session last went to (None without a known session)."""

    held: Mapping[str, float]
    prompt_tokens: float
    session_backend: str | None = None
    # with a session key: per backend the tokens of the other live sessions there, and
    # its cache in tokens (what `pricing.hold_pool` weighs a new prefix against)
    footprint: Mapping[str, float] | None = None
    cache_tokens: Mapping[str, float] | None = None
    # per backend the tokens the index predicts it holds, before the retention scales
    # them into `held` (what the engine's report is compared with)
    predicted: Mapping[str, float] | None = None
    # per backend its engine's measured retention (`Retention.measured`): what it held of
    # the index's predictions over its recent reports
    retention: Mapping[str, float] | None = None
    # with a TPOT objective: the backends whose recent answers meet it
    # (`TpotObjective.meeting`); None without one
    meeting_slo: frozenset[str] | None = None

    @property
    def any(self) -> bool:
        return any(v > 0 for v in self.held.values())


class AffinityTracker:
    """See the module docstring. `capacity_tokens` bounds each backend's index."""

    def __init__(self, backends: Iterable[str], capacity_tokens: Mapping[str, int],
                 block_tokens: float, max_sessions: int,
                 configured: Iterable[str] = (), live_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 retention: Retention | None = None,
                 objective: TpotObjective | None = None) -> None:
        self._block_tokens = block_tokens
        self.objective = objective
        self._indexes = {
            b: PrefixIndex(max(1, int(capacity_tokens[b] / block_tokens))) for b in backends}
        self.retention = (retention if retention is not None
                          else Retention(self._indexes, max_sessions))
        # backends whose bound the operator set: telemetry does not change it
        self._configured = frozenset(configured)
        self._reported: dict[str, int] = {}
        self._sessions = SessionTable(max_sessions, live_s)
        self._clock = clock
        self.hits = 0
        self.misses = 0
        self.held_tokens = 0.0
        self.prompt_tokens = 0.0

    def observe_capacity(self, backend: str, kv_tokens: int | None) -> None:
        """The server's KV pool in tokens as its telemetry reports it: the bound of its
        index from now on, unless configured per backend."""
        if (kv_tokens is None or kv_tokens <= 0 or backend in self._configured
                or self._reported.get(backend) == kv_tokens or backend not in self._indexes):
            return
        self._reported[backend] = kv_tokens
        self._indexes[backend].resize(int(kv_tokens / self._block_tokens))

    def lookup(self, prefix: PrefixKeys | None, session: str | None) -> Lookup | None:
        """What each backend holds of this request; None without a prefix or session."""
        if prefix is None and session is None:
            return None
        predicted: dict[str, float] = {}
        if prefix is not None and prefix.keys:
            for name, index in self._indexes.items():
                n = index.match(prefix.keys)
                if n:
                    predicted[name] = prefix.tokens(n)
        prompt = prefix.prompt_tokens if prefix is not None else 0.0
        last = None
        lost_credit = False
        if session is not None:
            seen = self._sessions.get(session)
            if seen is not None and seen[0] in self._indexes:
                backend, tokens = seen
                credit = min(tokens, prompt) if prefix is not None else tokens
                predicted[backend] = max(predicted.get(backend, 0.0), credit)
                prompt = max(prompt, credit)
                last = backend
                lost_credit = self.retention.lost(session, backend)
        share = self.retention.share
        held = {b: v * share(b) for b, v in predicted.items()}
        if lost_credit and last is not None:
            held[last] = 0.0  # its last turn there came back uncached: the engine evicted it
        if session is None:
            return Lookup(held, prompt, predicted=predicted)
        footprint = self._sessions.footprint(self._clock(), session)
        caches = {b: i.capacity * self._block_tokens for b, i in self._indexes.items()}
        meeting = self.objective.meeting() if self.objective is not None else None
        return Lookup(held, prompt, last, footprint, caches, predicted,
                      self.retention.measured, meeting)

    def record(self, prefix: PrefixKeys | None, session: str | None, backend: str,
               lookup: Lookup | None, count: bool = True) -> bool:
        """The request went to `backend`: index its prefix there and, with `count` (not
        for a retry of the same request), count a hit (the backend was believed to hold
        some of it) or a miss. Returns whether it hit."""
        index = self._indexes.get(backend)
        if index is None:
            return False
        if prefix is not None:
            index.insert(prefix.keys)
        held = lookup.held.get(backend, 0.0) if lookup is not None else 0.0
        prompt = lookup.prompt_tokens if lookup is not None else 0.0
        if session is not None:
            self._sessions.put(session, backend, prompt, self._clock())
        hit = held > 0
        if not count:
            return hit
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self.held_tokens += held
        self.prompt_tokens += prompt
        return hit

    def observe_cached(self, backend: str, session: str | None, predicted_share: float,
                       prompt: int, cached: int) -> None:
        """What `backend` reported it had cached of a request the router sent it
        (`prompt` tokens, `cached` of them) against the share of it the index predicted:
        `Retention.observe`."""
        if backend in self._indexes:
            self.retention.observe(backend, session, predicted_share, prompt, cached,
                                   self._block_tokens)

    def observe_pace(self, backend: str, tpot_ms: float) -> None:
        """A streamed answer of `backend` took `tpot_ms` per output token after its first
        (`TpotObjective.observe`; nothing without an objective)."""
        if self.objective is not None:
            self.objective.observe(backend, tpot_ms)

    def tpot_within_shares(self) -> dict[str, float]:
        """For /metrics: `TpotObjective.within_shares`; empty without an objective."""
        return {} if self.objective is None else self.objective.within_shares()

    def begin(self, session: str | None) -> None:
        """A request of `session` went upstream (`SessionTable.begin`)."""
        if session is not None:
            self._sessions.begin(session)

    def end(self, session: str | None) -> None:
        """That request ended: the session stays live `live_s` from now."""
        if session is not None:
            self._sessions.end(session, self._clock())

    def stats(self) -> dict[str, Any]:
        """For GET /policy: hit share, the share of prompt tokens routed to a backend
        believed to hold them, and each index's size against its bound."""
        seen = self.hits + self.misses
        return {
            "requests": seen,
            "hits": self.hits,
            "misses": self.misses,
            "hit_share": round(self.hits / seen, 4) if seen else None,
            "held_token_share": (round(self.held_tokens / self.prompt_tokens, 4)
                                 if self.prompt_tokens else None),
            "sessions": len(self._sessions),
            "retention": self.retention.stats(),
            "tpot_objective": (None if self.objective is None else
                               {"slo_ms": self.objective.slo_ms,
                                "backends": self.objective.report()}),
            "index_blocks": {b: {"blocks": len(i), "capacity": i.capacity}
                             for b, i in self._indexes.items()},
        }


def group_affinity(lookup: Lookup | None, groups: Sequence[GroupView], session: str | None,
                   prices: AffinityPrices, session_home: bool = False,
                   group_of: Mapping[str, str] | None = None) -> GroupAffinity | None:
    """The group choice's view of one request: per group the most prompt tokens one of
    its healthy servers holds. With `session_home`, when no server is believed to hold
    any and the client named a session, the session's home group is priced as holding
    the whole prompt, so every replica places a session in the same group (load
    permitting), at the price of placing new sessions by hash rather than by load.
    `group_of` (each backend's group) spares a pass over every group's servers: only
    the servers believed to hold something are looked at. With one group there is
    nothing to weigh: None."""
    if lookup is None or len(groups) < 2:
        return None
    held: dict[str, float] = {}
    holders = [(name, tokens) for name, tokens in lookup.held.items() if tokens > 0]
    if holders:
        if group_of is None:
            group_of = {b.name: g.name for g in groups for b in g.backends}
        by_name = {g.name: g for g in groups}
        for name, tokens in holders:
            group = by_name.get(group_of.get(name, ""))
            if group is not None and tokens > held.get(group.name, 0.0) and any(
                    b.name == name and b.healthy for b in group.backends):
                held[group.name] = tokens
    if session_home and not held and session is not None:
        home = home_group(session, [g.name for g in groups if g.any_healthy])
        if home is not None and lookup.prompt_tokens > 0:
            held[home] = lookup.prompt_tokens
    return GroupAffinity(held, lookup.prompt_tokens, prices) if held else None


def prices_of(settings: AffinitySettings) -> AffinityPrices:
    return AffinityPrices(
        prefill_ms_per_token=settings.prefill_ms_per_token, load_ms=settings.load_ms,
        balance_abs=settings.balance_abs, balance_rel=settings.balance_rel,
        min_match=settings.min_match,
        expected_output_tokens=settings.expected_output_tokens,
        eagle_saving_ms_per_token=settings.eagle_saving_ms_per_token)


def tracker_of(settings: AffinitySettings, backends: Sequence[str],
               clock: Callable[[], float] = time.monotonic) -> AffinityTracker:
    caps = {b: settings.cache_tokens_by_backend.get(b, settings.cache_tokens) for b in backends}
    return AffinityTracker(backends, caps, settings.block_bytes / settings.bytes_per_token,
                           settings.max_sessions, settings.cache_tokens_by_backend,
                           settings.session_live_s, clock,
                           Retention(backends, settings.max_sessions,
                                     settings.retention_weight, settings.retention_lost_below,
                                     settings.retention_applied),
                           TpotObjective(backends, settings.tpot_slo_ms)
                           if settings.tpot_slo_ms > 0 else None)
