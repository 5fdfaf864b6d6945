"""What affinity is worth, in milliseconds: pure arithmetic over tokens and loads.

Prefilling `u` uncached prompt tokens takes `u * prefill_ms_per_token` of the GPU, and
the GPU is shared: while a prefill batch runs, every running request of both servers of
that GPU waits for it. So a prefill costs `u * prefill_ms_per_token * (1 + load)`
request-milliseconds in a group already running `load` requests. Joining a group costs
the request `load_ms` for each request already there (its decode steps are shared).

- Group choice: each candidate group costs
  `uncached * prefill_ms_per_token * (1 + load) + load * load_ms`; the cheapest wins.
  With no prefix held anywhere every group has the same uncached tokens and the rule is
  least loaded, as without affinity. A group holding less than `min_match` of the
  prompt is priced as holding nothing: the first turn of a session shares only the
  system prompt with others, and where it lands its later turns follow, so its
  placement is a load decision, not a cache one (the gateway's `cache_threshold`). A
  group whose load passes `balance_rel * least + balance_abs` is priced as holding
  nothing too: affinity never piles sessions onto a group far busier than the idlest.
- Pool choice: a request whose prefix is on the other server of its group than the one
  the strategy picked re-prefills the difference on the shared GPU if it moves. When
  the strategy sends it to EAGLE-3 and the baseline holds more, it stays on the baseline
  (`affinity_hold_baseline`) when that prefill costs more than what EAGLE-3 saves on its
  answer. When the strategy sends it to the baseline (its answer to sustained load) and
  the client's session last went to this group's EAGLE-3 server, which holds more of it,
  it stays on EAGLE-3 (`affinity_hold_eagle`) when that prefill costs more than what the
  baseline saves on its answer. The saving is `expected_output_tokens` times the
  per-token difference: the cost model's predicted per-token times where there are
  some, else `eagle_saving_ms_per_token`. The EAGLE-3 hold needs the session key: a
  request that only shares a prefix with others (a common system prompt) follows the
  strategy, so one prefill teaches the baseline the prefix instead of every such request
  staying on EAGLE-3 under load. For a request with a session key the prefill of a
  server also counts the live sessions' prefixes a new prompt pushes out of a full
  cache (`placement_tokens`): a new session goes to the group's other server
  (`affinity_room_<pool>`) when the strategy's server has no room for it and that
  re-prefill costs more than the strategy's pool saves. What the strategy's pool saves
  counts, for a held session, the mixing cost too (`mixing_ms`): the GPU is
  time-sliced, so a request kept on the other server holds up every request on the
  strategy's for its whole answer, a cost it shares with the requests already there.
  Otherwise new sessions follow the strategy. No request is held on a server whose
  engine is measured to evict what the index predicts it holds (`_evicting`).
- Group switch: when the strategy switches a group's pool, the live sessions on the old
  pool's servers (`footprint`) follow it, each turn re-prefilling its whole context on
  the shared GPU: the two pools do not run side by side for long (`mixing_ms`). The
  switch is kept back (`affinity_keep_<pool>`) while that re-prefill costs more than
  what the new pool saves on one answer of every request in the group and of every
  live session it moves (sessions of `footprint` counted at this prompt's size), or
  while the old pool's servers hold the live sessions and the new pool's caches cannot
  (`overflows`): a radix cache smaller than the sessions that cycle through it evicts
  each before its next turn, so every turn there re-prefills its whole context. A
  switch away from servers that evict their sessions is not kept back by its price:
  their engines report under `EVICTING_RETENTION` of the index's predictions cached (the
  retention, `routing/affinity/retention.py`), so the sessions' next turns there
  re-prefill anyway, and the move re-prefills nothing that staying would not; it is
  still kept back where the new pool's caches cannot hold them either. With the
  operator's TPOT objective set, a switch gains nothing while the servers holding the
  live sessions answer within it (`meets_objective`, `objective.py`): the sessions'
  answers already meet the SLO there, and the move's re-prefill would cost some of them
  their TTFT.
- Leaving an evicting pool: where the strategy keeps a group on a pool whose servers
  evict the live sessions (`evicts`) and the other pool's caches have room for them
  (`room_tokens`, and not measured to evict either), each turn of every session
  re-prefills where it is what the engines no longer hold, round after round, while on
  the other pool only the first turns after the move do. The group moves
  (`affinity_leave_<pool>`) when one such round of re-prefills costs more than the
  strategy's pool saves on one answer of every request in the group and of every live
  session (`keep_group_pool`'s price, from the other side).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specrouter.backends import Pool, other_pool
from specrouter.observe.loadview import GroupView
from specrouter.routing.costmodel import PoolPrediction
from specrouter.routing.decision import Decision

if TYPE_CHECKING:
    from specrouter.routing.affinity.tracker import Lookup

#: A server whose engine reports less than this share of the index's predictions cached
#: (its measured retention) evicts the live sessions before their next turns: a thrashing
#: radix cache finds little of a session beyond a prefix shared by all of them, one that
#: holds the sessions finds most of what the index predicts.
EVICTING_RETENTION = 0.5

#: The reasons the affinity override gives (part of pool_choice.REASONS).
AFFINITY_REASONS: tuple[str, ...] = (
    "affinity_hold_baseline", "affinity_hold_eagle", "affinity_room_baseline",
    "affinity_room_eagle", "affinity_keep_baseline", "affinity_keep_eagle",
    "affinity_leave_baseline", "affinity_leave_eagle")


@dataclass(frozen=True, slots=True)
class AffinityPrices:
    prefill_ms_per_token: float = 0.021
    load_ms: float = 50.0
    balance_abs: float = 8.0
    balance_rel: float = 2.0
    min_match: float = 0.5
    expected_output_tokens: int = 256
    eagle_saving_ms_per_token: float = 2.0


@dataclass(frozen=True, slots=True)
class GroupAffinity:
    """What the group choice knows of one request's prefix: per group, the most prompt
    tokens one of its healthy servers holds, and the prompt's estimated tokens."""

    held: Mapping[str, float]
    prompt_tokens: float
    prices: AffinityPrices

    def cost(self, group: str, load: float, least: float) -> float:
        p = self.prices
        held = self.held.get(group, 0.0)
        if (load > p.balance_rel * least + p.balance_abs
                or held < p.min_match * self.prompt_tokens):
            held = 0.0
        uncached = max(0.0, self.prompt_tokens - held)
        return uncached * p.prefill_ms_per_token * (1.0 + load) + load * p.load_ms


def switch_cost_ms(extra_tokens: float, load: float, prices: AffinityPrices) -> float:
    """Request-milliseconds of prefilling `extra_tokens` more on a GPU running `load`."""
    return max(0.0, extra_tokens) * prices.prefill_ms_per_token * (1.0 + load)


def pool_saving_ms(pool: Pool, predictions: Mapping[Pool, PoolPrediction] | None,
                   prices: AffinityPrices) -> float:
    """What `pool` saves on one answer against the other pool: the predicted per-token
    difference where there are predictions, else `eagle_saving_ms_per_token`."""
    if predictions is not None and "eagle" in predictions and "baseline" in predictions:
        per_token = predictions[other_pool(pool)].tpot_ms - predictions[pool].tpot_ms
    else:
        per_token = prices.eagle_saving_ms_per_token
    return max(0.0, per_token) * prices.expected_output_tokens


def _most_held(group: GroupView, pool: Pool, held: Mapping[str, float]) -> tuple[str, float]:
    """The healthy server of `pool` in `group` holding most of the prompt, and how much."""
    return max(((b.name, held.get(b.name, 0.0)) for b in group.healthy_servers(pool)),
               key=lambda nh: nh[1], default=("", 0.0))


def placement_tokens(prompt: float, held: float, footprint: Mapping[str, float] | None,
                     caches: Mapping[str, float] | None, server: str) -> float:
    """Tokens a request makes some server prefill if it goes to `server`: its own prompt
    less what `server` holds, plus what that pushes out of a full cache of other live
    sessions' prefixes (they come back as prefills of their next turns)."""
    uncached = max(0.0, prompt - held)
    if footprint is None or caches is None or server not in caches:
        return uncached
    overflow = footprint.get(server, 0.0) + prompt - caches[server]
    return uncached + max(0.0, min(uncached, overflow))


def mixing_ms(group: GroupView, want: Pool, other: Pool,
              predictions: Mapping[Pool, PoolPrediction] | None,
              prices: AffinityPrices) -> float:
    """Request-milliseconds of keeping one more request on `other` while the strategy
    sends the group to `want`: the GPU is time-sliced, so every step `other` takes holds
    up each request on `want`, for the request's answer (`expected_output_tokens` x
    `other`'s predicted per-token time). The requests already on `other` keep that going
    anyway: the request bears its share, 1 / (1 + those requests). 0 without
    predictions or with nothing on `want`."""
    if predictions is None or other not in predictions:
        return 0.0
    on_want = sum(b.inflight for b in group.healthy_servers(want))
    on_other = sum(b.inflight for b in group.healthy_servers(other))
    if on_want <= 0:
        return 0.0
    answer_ms = prices.expected_output_tokens * predictions[other].tpot_ms
    return on_want * answer_ms / (1.0 + on_other)


def hold_pool(decision: Decision, group: GroupView, lookup: Lookup,
              prices: AffinityPrices) -> Decision:
    """`decision` (a strategy's choice for a request in `group`), or the other pool when
    going where the strategy says makes the shared GPU prefill more (the request's
    uncached prompt, and the live sessions' prefixes it pushes out of a full cache:
    `placement_tokens`) by more than the strategy's pool saves on the answer, plus, for a
    request held where its prefix is, what running beside the strategy's pool costs its
    requests (`mixing_ms`). A new session placed for cache room is not charged the
    mixing: a server whose live sessions overflow its KV pool also bounds its running
    batch and queues, a cost the re-prefill price leaves out and that outweighs it.

    Any request may stay on the baseline for its prefix (`affinity_hold_baseline`), and
    no request stays on a server measured to evict what the index predicts it holds
    (`_evicting`): its prefix is likely gone there.
    EAGLE-3 is kept only for a session whose last request went to the server that holds
    it (`affinity_hold_eagle`); a request sharing a prefix with others follows the
    strategy, so one prefill teaches the baseline the prefix. Cache room counts only for
    requests with a session key (`affinity_room_<pool>`: the other server has room for
    a new session's prefix where the strategy's has not)."""
    want = decision.pool
    other = other_pool(want)
    w_server, on_want = _most_held(group, want, lookup.held)
    o_server, on_other = _most_held(group, other, lookup.held)
    if not (w_server and o_server):
        return decision
    holds = on_other > on_want
    if holds and (_evicting(o_server, lookup)
                  or (other == "eagle" and lookup.session_backend != o_server)):
        return decision
    prompt = max(lookup.prompt_tokens, on_want, on_other)
    extra = (placement_tokens(prompt, on_want, lookup.footprint, lookup.cache_tokens, w_server)
             - placement_tokens(prompt, on_other, lookup.footprint, lookup.cache_tokens,
                                o_server))
    if extra <= 0:
        return decision
    gain = pool_saving_ms(want, decision.predictions, prices)
    if holds:
        gain += mixing_ms(group, want, other, decision.predictions, prices)
    if switch_cost_ms(extra, decision.load, prices) <= gain:
        return decision
    reason = f"affinity_hold_{other}" if holds else f"affinity_room_{other}"
    return replace(decision, pool=other, reason=reason, recalls=False)


def room_tokens(group: GroupView, pool: Pool, lookup: Lookup) -> float | None:
    """The cache tokens `pool`'s healthy servers in `group` have left for more sessions:
    their KV pools less the live sessions' prefixes there (None: a pool not known)."""
    caches, footprint = lookup.cache_tokens, lookup.footprint
    if caches is None or footprint is None:
        return None
    servers = group.healthy_servers(pool)
    if not servers or any(b.name not in caches for b in servers):
        return None
    return sum(caches[b.name] - max(0.0, footprint.get(b.name, 0.0)) for b in servers)


def overflows(moved: float, group: GroupView, old: Pool, new: Pool, lookup: Lookup) -> bool:
    """Whether moving `moved` live-session tokens from `old`'s servers, which hold them, to
    `new`'s overflows `new`'s caches. A radix cache evicts least recently used prefixes
    first, and the sessions come back in turn, so a cache that cannot hold them all
    evicts each one before its next turn: every turn re-prefills its whole context, not
    only the first after the move, for as long as the group stays there."""
    held_room = room_tokens(group, old, lookup)
    new_room = room_tokens(group, new, lookup)
    if held_room is None or new_room is None:
        return False
    return held_room >= 0 and moved > new_room


def evicts(group: GroupView, pool: Pool, lookup: Lookup) -> bool:
    """Whether every healthy server of `pool` in `group` that holds live sessions is
    measured to evict them (retention below `EVICTING_RETENTION`); False where one is not
    measured (its engine sends no cache report, or too few yet)."""
    servers = _with_sessions(group, pool, lookup)
    return bool(servers) and all(_evicting(name, lookup) for name in servers)


def _with_sessions(group: GroupView, pool: Pool, lookup: Lookup) -> list[str]:
    """`pool`'s healthy servers in `group` that hold live sessions."""
    footprint = lookup.footprint or {}
    return [b.name for b in group.healthy_servers(pool) if footprint.get(b.name, 0.0) > 0]


def meets_objective(group: GroupView, pool: Pool, lookup: Lookup) -> bool:
    """Whether every server of `pool` in `group` with live sessions answers within the
    operator's TPOT objective (`Lookup.meeting_slo`; never without an objective)."""
    servers = _with_sessions(group, pool, lookup)
    return (lookup.meeting_slo is not None and bool(servers)
            and all(s in lookup.meeting_slo for s in servers))


def _evicting(server: str, lookup: Lookup) -> bool:
    """Whether `server`'s engine is measured to evict what the index predicts it holds."""
    return (lookup.retention or {}).get(server, 1.0) < EVICTING_RETENTION


def _live_tokens(group: GroupView, pool: Pool, footprint: Mapping[str, float]) -> float:
    """The live sessions' tokens on `pool`'s healthy servers in `group`."""
    return sum(max(0.0, footprint.get(b.name, 0.0)) for b in group.healthy_servers(pool))


def leave_evicting_pool(decision: Decision, previous_pool: Pool, group: GroupView,
                        lookup: Lookup, prices: AffinityPrices, now: float) -> Decision:
    """`decision`, or the group moved to the other pool when the strategy keeps it on
    `previous_pool`, whose servers evict the live sessions, and the move pays for itself
    (module docstring, leaving an evicting pool). Only for a request with a session key
    (the footprint is known) and a strategy that predicts both pools."""
    pool = previous_pool
    predictions = decision.predictions
    if (decision.pool != pool or decision.state.pool != pool or lookup.footprint is None
            or predictions is None or len(predictions) < 2 or not evicts(group, pool, lookup)):
        return decision
    other = other_pool(pool)
    moved = _live_tokens(group, pool, lookup.footprint)
    room = room_tokens(group, other, lookup)
    if room is None or moved > room or evicts(group, other, lookup):
        return decision
    measured = lookup.retention or {}
    kept = max(measured.get(name, 0.0) for name in _with_sessions(group, pool, lookup))
    sessions = moved / max(lookup.prompt_tokens, 1.0)
    loss = (decision.load + 1.0 + sessions) * pool_saving_ms(pool, predictions, prices)
    if switch_cost_ms(moved * (1.0 - kept), decision.load, prices) <= loss:
        return decision
    return replace(decision, pool=other, state=decision.state.switched(other, now),
                   reason=f"affinity_leave_{pool}")


def keep_group_pool(decision: Decision, previous_pool: Pool, previous_since: float,
                    group: GroupView, lookup: Lookup, prices: AffinityPrices) -> Decision:
    """`decision`, or the group kept on `previous_pool` when the strategy switches it
    away and the live sessions on `previous_pool`'s servers would re-prefill more than
    the switch gains (module docstring, group switch). Only for a request with a session
    key (the footprint is known) and a strategy that predicts both pools (the gain is
    their difference); the group's accept estimate is kept either way."""
    if decision.pool == previous_pool or decision.state.pool == previous_pool:
        return decision
    predictions = decision.predictions
    if lookup.footprint is None or predictions is None or len(predictions) < 2:
        return decision
    moved = _live_tokens(group, previous_pool, lookup.footprint)
    if moved <= 0:
        return decision
    sessions = moved / max(lookup.prompt_tokens, 1.0)
    gain = (0.0 if meets_objective(group, previous_pool, lookup) else
            (decision.load + 1.0 + sessions) * pool_saving_ms(decision.pool, predictions,
                                                              prices))
    held = not evicts(group, previous_pool, lookup)  # else the move re-prefills nothing
    if ((not held or switch_cost_ms(moved, decision.load, prices) <= gain)
            and not overflows(moved, group, previous_pool, decision.pool, lookup)):
        return decision
    state = replace(decision.state, pool=previous_pool, since=previous_since)
    return replace(decision, pool=previous_pool, state=state,
                   reason=f"affinity_keep_{previous_pool}", recalls=False)
