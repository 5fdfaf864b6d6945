"""The GPU group for one new request."""

from __future__ import annotations

import random
from collections.abc import Sequence

from specrouter.observe.loadview import GroupView, LoadSignal
from specrouter.routing.affinity.pricing import GroupAffinity


def choose_group(
    groups: Sequence[GroupView], signal: LoadSignal, rng: random.Random,
    affinity: GroupAffinity | None = None,
) -> GroupView | None:
    """The group for a request; None when no group has a healthy backend.

    Up to two candidates: compare all (random among ties). More: power of two choices
    (two distinct random candidates), so that router replicas do not all herd onto the
    same momentarily emptiest group. Without `affinity` the less loaded candidate wins.
    With it, every group believed to hold part of the request's prefix joins the
    candidates, and the cheapest by `GroupAffinity.cost` wins (uncached prefill on the
    shared GPU against load): with nothing held anywhere that is the less loaded one.
    """
    live = [g for g in groups if g.any_healthy]
    if len(live) < 2:
        return live[0] if live else None
    candidates = rng.sample(live, 2) if len(live) > 2 else live
    if affinity is None:
        least = min(g.load(signal) for g in candidates)
        return rng.choice([g for g in candidates if g.load(signal) == least])
    candidates += [g for g in live if affinity.held.get(g.name, 0.0) > 0
                   and g not in candidates]
    loads = {g.name: g.load(signal) for g in live}
    floor = min(loads.values())
    costs = {g.name: affinity.cost(g.name, loads[g.name], floor) for g in candidates}
    best = min(costs.values())
    return rng.choice([g for g in candidates if costs[g.name] == best])
