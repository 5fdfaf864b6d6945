"""Keys the store did not write, and answers it did not ask for: no background loop dies.

A dead refresh loop is the worst failure the store can have: it still reports itself
connected while the other replicas' counts stay frozen in its view, so the router sees load
that has long gone. Each test here would have killed one loop before the store learnt to
read defensively.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures.procs import eventually
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.anyio


def _redis_now_ms(server: RedisServer) -> int:
    seconds, micros = server.client().time()  # type: ignore[misc]
    return int(seconds) * 1000 + int(micros) // 1000


def _intrude(server: RedisServer, fields: dict[str, str], score_offset_ms: int = 0,
             name: str = "intruder") -> None:
    """A replica id the cluster never started, heard from at Redis's now + the offset, with
    these counts in a hash without a TTL."""
    client = server.client()
    client.hset(f"specrouter:inflight:{name}", mapping=fields)
    client.zadd("specrouter:replicas", {name: _redis_now_ms(server) + score_offset_ms})


async def test_a_count_that_is_not_an_integer_is_skipped_and_the_view_keeps_moving(
    redis_server: RedisServer, stores: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    a = await stores(redis_server, "r1", ttl_s=10.0)  # the intruder stays alive meanwhile
    b = await stores(redis_server, "r2", ttl_s=10.0)
    _intrude(redis_server, {"gpu0/eagle": "lots", "gpu0/base": "2"})
    with caplog.at_level(logging.WARNING, logger="specrouter.state"):
        await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 2}, what="the valid count")
        lease = b.acquire("gpu0/eagle")
        await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 2, "gpu0/eagle": 1},
                         what="b's new count after the bad one")
        lease.release()
        await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 2}, what="b's release")
    assert a.status()["connected"]
    warnings = [r.getMessage() for r in caplog.records if "not an integer" in r.getMessage()]
    assert len(set(warnings)) == 1 and "'intruder'" in warnings[0]


async def test_a_policy_that_cannot_be_read_is_replaced_by_the_replicas(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    await a.ensure_policy({"mode": "auto"})
    await eventually(lambda: b.get_policy() is not None, what="b adopted the policy")
    client = redis_server.client()
    client.hset("specrouter:policy", mapping={"doc": "{not json", "version": "banana"})
    client.publish("specrouter:policy:changed", "banana")
    await eventually(lambda: client.hget("specrouter:policy", "version") == "1",
                     what="a replica wrote its policy back over the unreadable one")
    assert client.hget("specrouter:policy", "doc") == '{"mode":"auto"}'
    # Every loop is still alive: counts flow and a policy write propagates.
    b.acquire("gpu0/eagle")
    await eventually(lambda: a.cluster_inflight() == {"gpu0/eagle": 1}, what="b's count")
    record = await a.put_policy({"mode": "tuned"})
    await eventually(lambda: b.get_policy() == record, what="the new policy at b")


async def test_an_answer_to_the_wrong_question_drops_the_connections_and_heals(
    redis_server: RedisServer, stores: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A pooled connection that still holds an earlier command's reply hands it to the next
    command; the store must not die of it, nor keep trusting its connections."""
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    refresh = a._scripts._refresh
    answered_wrong = []

    async def wrong_once(**kwargs: Any) -> Any:
        if not answered_wrong:
            answered_wrong.append(True)
            return 1  # what the publish script answers, not a refresh
        return await refresh(**kwargs)

    a._scripts._refresh = wrong_once
    with caplog.at_level(logging.ERROR, logger="specrouter.state"):
        await eventually(lambda: bool(answered_wrong), what="the wrong answer")
        b.acquire("gpu0/base")
        await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 1},
                         what="a's view moving again")
        await eventually(lambda: a.status()["connected"], what="a connected again")
    assert any("unexpected error" in r.getMessage() and "TypeError" in r.getMessage()
               for r in caplog.records)


async def test_an_entry_scored_in_the_future_never_counts_and_is_removed(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    _intrude(redis_server, {"gpu0/eagle": "7"}, score_offset_ms=3_600_000, name="ghost")
    client = redis_server.client()
    await eventually(lambda: client.zscore("specrouter:replicas", "ghost") is None,
                     what="the future-scored member dropped")
    assert not client.exists("specrouter:inflight:ghost")
    lease = b.acquire("gpu0/eagle")  # a refresh after the intrusion shows b's count only
    await eventually(lambda: a.cluster_inflight() == {"gpu0/eagle": 1}, what="b's count")
    lease.release()
    await eventually(lambda: a.cluster_inflight() == {}, what="no phantom load")


async def test_a_hash_without_ttl_expires_like_a_replicas(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    _intrude(redis_server, {"gpu0/base": "3"}, name="stale")
    client = redis_server.client()
    await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 3}, what="its count, alive")
    assert 0 < client.pttl("specrouter:inflight:stale") <= 1000  # given the store's TTL
    await eventually(lambda: a.cluster_inflight() == {}, timeout=5.0,
                     what="its count gone once it is older than the TTL")
    await eventually(lambda: not client.exists("specrouter:inflight:stale"), timeout=5.0,
                     what="the hash expired")
