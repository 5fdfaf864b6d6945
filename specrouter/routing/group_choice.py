"""The GPU group for one new request."""

from __future__ import annotations

import random
from collections.abc import Sequence

from specrouter.observe.loadview import GroupView, LoadSignal


def choose_group(
    groups: Sequence[GroupView], signal: LoadSignal, rng: random.Random
) -> GroupView | None:
    """Least-loaded group with a healthy backend; None when there is none.

    Up to two candidates: compare all (random among ties). More: power of two choices
    (two distinct random candidates, the less loaded wins, random on a tie), so that
    router replicas do not all herd onto the same momentarily emptiest group.
    """
    live = [g for g in groups if g.any_healthy]
    if not live:
        return None
    if len(live) > 2:
        live = rng.sample(live, 2)
    least = min(g.load(signal) for g in live)
    return rng.choice([g for g in live if g.load(signal) == least])
