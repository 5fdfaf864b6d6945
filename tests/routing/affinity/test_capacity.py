"""Each backend's index is bounded by the KV pool its telemetry reports."""

from __future__ import annotations

from specrouter.config import AffinitySettings
from specrouter.observe.telemetry import parse_v1_loads
from specrouter.routing.affinity.keys import PrefixKeys
from specrouter.routing.affinity.tracker import tracker_of


def rank(tokens: int) -> dict[str, object]:
    return {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 10,
            "max_total_num_tokens": tokens, "max_running_requests": 48, "token_usage": 0.1}


def test_v1_loads_carries_the_kv_pool_summed_over_ranks() -> None:
    sample = parse_v1_loads({"loads": [rank(300_000), rank(200_000)]}, 1.0)
    assert sample.kv_tokens == 500_000
    without = rank(1)
    del without["max_total_num_tokens"]
    assert parse_v1_loads({"loads": [without]}, 1.0).kv_tokens is None


def test_the_reported_pool_bounds_the_index_unless_configured() -> None:
    settings = AffinitySettings(cache_tokens=512 * 100, block_bytes=2048,
                                cache_tokens_by_backend={"b1": 512 * 50})
    t = tracker_of(settings, ["b0", "b1"])
    t.record(PrefixKeys(tuple(range(80)), 512.0, 512.0 * 80), None, "b0", None)
    t.observe_capacity("b0", 512 * 30)
    t.observe_capacity("b1", 512 * 10)
    t.observe_capacity("b0", None)
    t.observe_capacity("nobody", 512)
    blocks = t.stats()["index_blocks"]
    assert blocks["b0"] == {"blocks": 30, "capacity": 30}
    assert blocks["b1"]["capacity"] == 50
    # the leading blocks of the prompt survive the shrink
    look = t.lookup(PrefixKeys(tuple(range(80)), 512.0, 512.0 * 80), None)
    assert look is not None and look.held["b0"] == 512.0 * 30
