"""The group choice with affinity (specrouter.routing.group_choice)."""

from __future__ import annotations

import random

from specrouter.routing.affinity.pricing import AffinityPrices, GroupAffinity
from specrouter.routing.affinity.tracker import Lookup, group_affinity
from specrouter.routing.group_choice import choose_group
from tests.routing.helpers import group

PRICES = AffinityPrices()


def held(groups: dict[str, float], prompt: float = 30_000.0) -> GroupAffinity:
    return GroupAffinity(groups, prompt, PRICES)


def test_the_group_holding_the_prefix_wins_over_a_less_loaded_one() -> None:
    groups = [group("g0", eagle=1), group("g1", eagle=4)]
    for seed in range(20):
        chosen = choose_group(groups, "inflight", random.Random(seed), held({"g1": 29_000.0}))
        assert chosen is not None and chosen.name == "g1"


def test_a_group_holding_the_prefix_joins_the_two_sampled_ones() -> None:
    groups = [group(f"g{i}", eagle=1) for i in range(8)]
    for seed in range(20):
        chosen = choose_group(groups, "inflight", random.Random(seed), held({"g5": 29_000.0}))
        assert chosen is not None and chosen.name == "g5"


def test_load_beyond_the_guard_wins_over_affinity() -> None:
    groups = [group("g0", eagle=1), group("g1", eagle=12)]  # 12 > 2 * 1 + 8
    chosen = choose_group(groups, "inflight", random.Random(0), held({"g1": 29_000.0}))
    assert chosen is not None and chosen.name == "g0"


def test_with_nothing_held_the_choice_is_the_least_loaded() -> None:
    groups = [group("g0", eagle=3), group("g1", eagle=2)]
    chosen = choose_group(groups, "inflight", random.Random(0), held({}))
    assert chosen is not None and chosen.name == "g1"


def test_a_short_prefix_does_not_outweigh_much_load() -> None:
    # 500 tokens held saves 0.021 * 500 * (1 + 6) = 73.5 ms; 5 more requests cost 250 ms
    groups = [group("g0", eagle=1), group("g1", eagle=6)]
    chosen = choose_group(groups, "inflight", random.Random(0), held({"g1": 500.0}, 2000.0))
    assert chosen is not None and chosen.name == "g0"


def test_group_affinity_takes_each_groups_best_healthy_server() -> None:
    groups = [group("g0", base_ok=False), group("g1")]
    lookup = Lookup({"g0-base": 9000.0, "g0-eagle": 100.0, "g1-base": 50.0}, 10_000.0)
    a = group_affinity(lookup, groups, None, PRICES)
    assert a is not None and dict(a.held) == {"g0": 100.0, "g1": 50.0}
    # the router passes each backend's group, so that only the holders are looked at
    group_of = {b.name: g.name for g in groups for b in g.backends}
    again = group_affinity(lookup, groups, None, PRICES, group_of=group_of)
    assert again is not None and dict(again.held) == dict(a.held)


def test_with_session_home_a_new_session_is_priced_as_held_by_its_home_group() -> None:
    groups = [group("g0"), group("g1"), group("g2")]
    assert group_affinity(Lookup({}, 4000.0), groups, "session-1", PRICES) is None
    a = group_affinity(Lookup({}, 4000.0), groups, "session-1", PRICES, session_home=True)
    assert a is not None and list(a.held.values()) == [4000.0]
    home = next(iter(a.held))
    chosen = choose_group(groups, "inflight", random.Random(0), a)
    assert chosen is not None and chosen.name == home
    assert group_affinity(Lookup({}, 4000.0), groups, None, PRICES, session_home=True) is None
    assert group_affinity(None, groups, "session-1", PRICES, session_home=True) is None


def test_a_group_holding_less_than_min_match_of_the_prompt_is_priced_as_holding_none() -> None:
    # the first turn of a session shares only the system prompt with another session
    groups = [group("g0", eagle=2), group("g1", eagle=1)]
    first_turn = held({"g0": 4000.0}, 20_000.0)
    chosen = choose_group(groups, "inflight", random.Random(0), first_turn)
    assert chosen is not None and chosen.name == "g1"
    later_turn = held({"g0": 19_000.0}, 20_000.0)
    chosen = choose_group(groups, "inflight", random.Random(0), later_turn)
    assert chosen is not None and chosen.name == "g0"
