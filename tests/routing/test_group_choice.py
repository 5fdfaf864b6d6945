"""The group choice: least loaded, power of two choices among many."""

from __future__ import annotations

import random
from collections import Counter

from specrouter.routing.group_choice import choose_group
from tests.routing.helpers import group


def test_choose_group_least_loaded_and_skips_dead() -> None:
    rng = random.Random(1)
    a, b = group("a", eagle=5), group("b", eagle=2)
    dead = group("c", eagle_ok=False, base_ok=False)
    assert choose_group([a, b, dead], "inflight", random.Random(0)) is not dead
    assert choose_group([a, b], "inflight", rng) is b
    assert choose_group([dead], "inflight", rng) is None
    assert choose_group([], "inflight", rng) is None
    # A group with only its baseline alive is still a candidate.
    half = group("h", eagle=9, eagle_ok=False)
    assert choose_group([half, dead], "inflight", rng) is half


def test_choose_group_ties_are_random() -> None:
    rng = random.Random(7)
    a, b = group("a", eagle=3), group("b", eagle=3)
    picks = Counter(choose_group([a, b], "inflight", rng).name for _ in range(400))  # type: ignore[union-attr]
    assert picks["a"] > 150 and picks["b"] > 150


def test_choose_group_power_of_two_among_many() -> None:
    rng = random.Random(3)
    groups = [group(f"g{i}", eagle=i) for i in range(8)]
    picks = Counter(choose_group(groups, "inflight", rng).name for _ in range(2000))  # type: ignore[union-attr]
    # The most loaded group can never win a pairwise comparison; the least loaded wins
    # every pair it is drawn in (probability 2/8), so it is picked about 1/4 of the time.
    assert picks["g7"] == 0
    assert 400 < picks["g0"] < 600
    assert set(picks) == {f"g{i}" for i in range(7)}  # not always the global minimum
