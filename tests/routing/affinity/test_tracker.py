"""The router's affinity state (specrouter.routing.affinity.tracker)."""

from __future__ import annotations

from specrouter.config import AffinitySettings
from specrouter.routing.affinity.keys import PrefixKeys
from specrouter.routing.affinity.tracker import tracker_of


def keys(*k: int, prompt: float | None = None) -> PrefixKeys:
    return PrefixKeys(k, 512.0, prompt if prompt is not None else 512.0 * len(k) + 100)


def test_record_then_lookup_and_stats() -> None:
    t = tracker_of(AffinitySettings(cache_tokens=512 * 10, block_bytes=2048),
                   ["b0", "b1"])
    first = keys(1, 2)
    assert t.lookup(None, None) is None
    look = t.lookup(first, None)
    assert look is not None and not look.any
    assert t.record(first, None, "b0", look) is False
    second = keys(1, 2, 3)
    look = t.lookup(second, None)
    assert look is not None and dict(look.held) == {"b0": 1024.0}
    assert t.record(second, None, "b0", look) is True
    stats = t.stats()
    assert (stats["hits"], stats["misses"], stats["hit_share"]) == (1, 1, 0.5)
    assert stats["held_token_share"] == round(1024.0 / (1124.0 + 1636.0), 4)
    assert stats["index_blocks"] == {"b0": {"blocks": 3, "capacity": 10},
                                     "b1": {"blocks": 0, "capacity": 10}}


def test_per_backend_capacity() -> None:
    t = tracker_of(AffinitySettings(cache_tokens=512 * 10, block_bytes=2048,
                                    cache_tokens_by_backend={"b1": 512 * 3}), ["b0", "b1"])
    assert t.stats()["index_blocks"]["b1"]["capacity"] == 3


def test_a_session_credits_its_last_backend() -> None:
    t = tracker_of(AffinitySettings(), ["b0", "b1"])
    look = t.lookup(None, "s")
    assert look is not None
    t.record(None, "s", "b1", look)
    t.record(keys(5, 6, prompt=3000.0), "s", "b1", t.lookup(keys(5, 6, prompt=3000.0), "s"))
    # a rewritten history shares no block, but the session's backend is credited
    look = t.lookup(keys(7, 8, 9, prompt=5000.0), "s")
    assert look is not None and dict(look.held) == {"b1": 3000.0}
    assert t.stats()["sessions"] == 1


def test_a_session_lookup_carries_its_backend_and_the_live_footprint() -> None:
    now = [0.0]
    settings = AffinitySettings(cache_tokens=512 * 10, block_bytes=2048, session_live_s=10.0)
    t = tracker_of(settings, ["b0", "b1"], clock=lambda: now[0])
    first = keys(1, 2)
    t.record(first, "s1", "b0", t.lookup(first, "s1"))
    t.record(keys(7), "s2", "b1", t.lookup(keys(7), "s2"))
    look = t.lookup(keys(1, 2, 3), "s1")
    assert look is not None and look.session_backend == "b0"
    assert look.footprint == {"b0": 0.0, "b1": 612.0}  # s1's own entry left out
    assert look.cache_tokens == {"b0": 5120.0, "b1": 5120.0}
    now[0] = 11.0
    look = t.lookup(keys(1, 2, 3), "s1")
    assert look is not None and look.footprint == {"b0": 0.0, "b1": 0.0}
    # without a session key there is no footprint: single requests are priced as before
    plain = t.lookup(keys(1, 2, 3), None)
    assert plain is not None and plain.footprint is None and plain.session_backend is None
