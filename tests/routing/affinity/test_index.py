"""The per-backend prefix index and the session table (specrouter.routing.affinity.index)."""

from __future__ import annotations

import pytest

from specrouter.routing.affinity.index import PrefixIndex, SessionTable, matched_tokens
from specrouter.routing.affinity.keys import PrefixKeys


def test_match_counts_the_leading_blocks_held() -> None:
    index = PrefixIndex(100)
    index.insert((1, 2, 3))
    assert index.match((1, 2, 3, 4)) == 3
    assert index.match((1, 2, 3)) == 3
    assert index.match((1, 2, 9, 10)) == 2
    assert index.match((1, 8, 9, 10, 11, 12)) == 1
    assert index.match((9, 1, 2)) == 0
    assert index.match(()) == 0
    chain = tuple(range(100, 160))
    index.insert(chain[:37])
    assert all(index.match(chain[:n]) == min(n, 37) for n in range(1, 61))
    assert matched_tokens(index, PrefixKeys((1, 2, 7), 256.0, 700.0)) == 512.0


def test_the_bound_evicts_least_recent_prompts_longest_prefix_first() -> None:
    index = PrefixIndex(5)
    index.insert((1, 2, 3))  # session A
    index.insert((7, 8))  # session B, more recent
    assert len(index) == 5
    index.insert((1, 2, 3, 4))  # A again, one block longer: B's deepest block goes first
    assert len(index) == 5
    assert index.match((1, 2, 3, 4)) == 4
    assert index.match((7, 8)) == 1
    index.insert((5, 6))
    assert index.match((7, 8)) == 0
    assert index.match((1, 2, 3, 4)) == 3  # the A chain lost its leaf, not its root


def test_a_prompt_longer_than_the_bound_keeps_its_leading_blocks() -> None:
    index = PrefixIndex(3)
    index.insert(tuple(range(10)))
    assert index.match(tuple(range(10))) == 3


def test_the_bound_is_positive() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_session_table_keeps_the_most_recent_sessions() -> None:
    table = SessionTable(2)
    table.put("a", "b0", 100.0)
    table.put("b", "b1", 200.0)
    table.put("a", "b2", 300.0)  # refreshes a
    table.put("c", "b0", 50.0)
    assert table.get("b") is None
    assert table.get("a") == ("b2", 300.0)
    assert len(table) == 2


def test_a_sessions_footprint_counts_on_its_last_backend_while_it_is_live() -> None:
    table = SessionTable(10, live_s=5.0)
    table.put("a", "b0", 100.0, now=0.0)
    table.put("b", "b0", 50.0, now=1.0)
    table.put("c", "b1", 70.0, now=2.0)
    assert table.footprint(2.0) == {"b0": 150.0, "b1": 70.0}
    assert table.footprint(2.0, without="a") == {"b0": 50.0, "b1": 70.0}
    table.put("a", "b1", 120.0, now=3.0)  # the session moved and grew
    assert table.footprint(3.0) == {"b0": 50.0, "b1": 190.0}
    # "b" was last seen at 1.0: not live past 6.0; the table still knows it
    assert table.footprint(6.5) == {"b0": 0.0, "b1": 190.0}
    assert table.get("b") == ("b0", 50.0)


def test_a_dropped_session_leaves_the_footprint() -> None:
    table = SessionTable(1, live_s=60.0)
    table.put("a", "b0", 100.0)
    table.put("b", "b0", 10.0)
    assert table.footprint(0.0) == {"b0": 10.0}


def test_a_session_stays_live_while_its_request_is_in_flight_and_live_s_after_it_ends() -> None:
    table = SessionTable(10, live_s=5.0)
    table.put("a", "b0", 100.0, now=0.0)
    table.begin("a")
    table.put("b", "b0", 50.0, now=0.0)
    # a long answer: "a" streams past live_s and still holds its prefix on b0
    assert table.footprint(20.0) == {"b0": 100.0}
    table.end("a", now=30.0)
    assert table.footprint(34.0) == {"b0": 100.0}
    assert table.footprint(35.5) == {"b0": 0.0}
