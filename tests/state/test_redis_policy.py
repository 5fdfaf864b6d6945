"""The shared policy: compare-and-set versions, propagation within 1 s, audit log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from specrouter.state import PolicyRecord, VersionConflict
from tests.fixtures.procs import eventually
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.anyio


def version_of(store: Any) -> int:
    record = store.get_policy()
    return 0 if record is None else int(record.version)


async def test_first_startup_seeds_version_1_and_later_replicas_adopt_it(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    first = await a.ensure_policy({"from": "a"})
    adopted = await b.ensure_policy({"from": "b"})  # the shared policy wins over b's file
    assert (first.version, adopted.version, adopted.doc) == (1, 1, {"from": "a"})


async def test_compare_and_set_refuses_a_stale_write(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    await a.ensure_policy({"n": 0})
    results = await asyncio.gather(
        a.put_policy({"n": "a"}, expected_version=1, actor="alice"),
        b.put_policy({"n": "b"}, expected_version=1, actor="bob"),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, PolicyRecord)]
    losers = [r for r in results if isinstance(r, VersionConflict)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert winners[0].version == 2
    assert losers[0].current is not None and losers[0].current.version == 2


async def test_concurrent_unconditional_writes_lose_nothing(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    writes = [s.put_policy({"i": i}) for i in range(10) for s in (a, b)]
    records = await asyncio.gather(*writes)
    assert sorted(r.version for r in records) == list(range(1, 21))
    audit = await a.audit(100)
    assert [e.version for e in audit] == list(range(20, 0, -1))
    last = max(records, key=lambda r: r.version)
    for store in (a, b):
        await eventually(lambda s=store: s.get_policy() == last, what="both at the last write")


async def test_change_reaches_another_replica_within_1s_through_pubsub(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    # Reconcile far too slow to matter: only pub/sub can deliver within the bound.
    b = await stores(redis_server, "r2", reconcile_interval_s=10.0)
    await a.ensure_policy({"mode": "auto"})
    await eventually(lambda: version_of(b) == 1, what="b at v1")
    seen: list[PolicyRecord] = []
    b.on_policy_change(seen.append)
    record = await a.put_policy({"mode": "baseline-only"}, expected_version=1, actor="ops")
    took = await eventually(lambda: version_of(b) == 2, timeout=5, what="b at v2")
    assert took < 1.0
    assert seen == [record] and b.get_policy().doc == {"mode": "baseline-only"}


async def test_a_lost_pubsub_message_is_healed_by_reconcile_within_1s(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    b = await stores(redis_server, "r2", reconcile_interval_s=0.5)
    await b.ensure_policy({"mode": "auto"})
    # A write whose notification never arrives: straight into the hash, no PUBLISH.
    redis_server.client().hset(
        "specrouter:policy",
        mapping={"doc": json.dumps({"mode": "eagle-only"}), "version": 2,
                 "updated_at": 1.0, "updated_by": "elsewhere"},
    )
    took = await eventually(lambda: version_of(b) == 2, timeout=5, what="reconcile")
    assert took < 1.0
    assert b.get_policy().doc == {"mode": "eagle-only"}


async def test_audit_log_is_capped_and_newest_first(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1", audit_cap=5)
    for i in range(8):
        await a.put_policy({"i": i}, actor=f"admin{i}")
    entries = await a.audit(50)
    assert [e.version for e in entries] == [8, 7, 6, 5, 4]
    assert entries[0].doc == {"i": 7} and entries[0].updated_by == "admin7"
    assert entries[0].action == "put"
    assert redis_server.client().llen("specrouter:policy:audit") == 5
    assert [e.version for e in await a.audit(2)] == [8, 7]


async def test_a_failing_listener_does_not_stop_propagation(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    got: list[int] = []

    def broken(_: PolicyRecord) -> None:
        raise RuntimeError("listener bug")

    b.on_policy_change(broken)
    unsubscribe = b.on_policy_change(lambda r: got.append(r.version))
    await a.put_policy({"x": 1})
    await eventually(lambda: got == [1], what="second listener called")
    unsubscribe()
    await a.put_policy({"x": 2})
    await eventually(lambda: version_of(b) == 2, what="v2")
    assert got == [1]
