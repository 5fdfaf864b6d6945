"""Cluster-wide locks and shared cost-probe readings, on a real redis-server (two stores on
one Redis) and on the embedded store: one holder at a time, compare-and-delete release,
expiry of a dead holder's lock, each reading taken once by every other replica."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from specrouter.state import InMemoryStore, ProbeReading, StateStore, StateUnavailable
from tests.fixtures.procs import ManagedProcess, eventually
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.anyio


def reading(by: str, step_ms: float = 7.0) -> ProbeReading:
    return ProbeReading("gpu0", "baseline", 1.0, step_ms, time.time(), by, uuid.uuid4().hex,
                        9000.0)


async def check_one_holder_and_compare_and_delete(a: StateStore, b: StateStore) -> None:
    token = await a.try_lock("cost-probe:gpu0", 30.0)
    assert token is not None
    assert await b.try_lock("cost-probe:gpu0", 30.0) is None
    assert await a.try_lock("cost-probe:gpu0", 30.0) is None  # not re-entrant either
    assert await b.try_lock("cost-probe:gpu1", 30.0) is not None  # one lock per name
    await b.unlock("cost-probe:gpu0", "not-the-token")
    assert await b.try_lock("cost-probe:gpu0", 30.0) is None
    await a.unlock("cost-probe:gpu0", token)
    second = await b.try_lock("cost-probe:gpu0", 30.0)
    assert second is not None
    await a.unlock("cost-probe:gpu0", token)  # a's stale token leaves b's lock alone
    assert await a.try_lock("cost-probe:gpu0", 30.0) is None


async def test_one_holder_at_a_time_and_only_the_holder_releases(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a, b = await stores(redis_server, "r1"), await stores(redis_server, "r2")
    await check_one_holder_and_compare_and_delete(a, b)
    holder = redis_server.client().get("specrouter:lock:cost-probe:gpu0")
    assert holder is not None and holder.startswith("r2:")  # readable in redis-cli


async def test_the_embedded_store_has_the_same_lock_semantics() -> None:
    store = InMemoryStore("r1")
    await check_one_holder_and_compare_and_delete(store, store)
    taken_at = time.monotonic()
    assert await store.try_lock("short", 0.2) is not None
    assert await store.try_lock("short", 0.2) is None
    await eventually(lambda: time.monotonic() > taken_at + 0.2, what="the ttl to pass")
    assert await store.try_lock("short", 0.2) is not None


HOLDER = """
import asyncio, os
from specrouter.state import StateSettings, make_store

async def main():
    store = make_store(StateSettings(redis_url=os.environ["HOLDER_REDIS_URL"]), "holder")
    await store.start()
    token = await store.try_lock("cost-probe:gpu0", float(os.environ["HOLDER_TTL_S"]))
    print("locked" if token else "refused", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_the_lock_of_a_holder_killed_mid_probe_expires_within_its_ttl(
    redis_server: RedisServer,
    stores: Callable[..., Any],
    process_factory: list[ManagedProcess],
) -> None:
    other = await stores(redis_server, "other")
    # long enough that the lock is still held when checked on a loaded host; the
    # expiry is timed from what was left of it when its holder died
    ttl_s = 3.0
    holder = ManagedProcess([sys.executable, "-c", HOLDER], env={
        "HOLDER_REDIS_URL": redis_server.url(), "HOLDER_TTL_S": str(ttl_s)}).start()
    process_factory.append(holder)
    await eventually(lambda: "locked" in holder.output(), timeout=30,
                     what=f"the holder's lock; its output:\n{holder.output()}")
    assert await other.try_lock("cost-probe:gpu0", 30.0) is None
    holder.signal(signal.SIGKILL)
    assert holder.proc is not None
    holder.proc.wait(10)
    killed_at = time.monotonic()
    left_s = redis_server.client().pttl("specrouter:lock:cost-probe:gpu0") / 1000
    assert 0 < left_s <= ttl_s  # the lock outlived its holder, for its ttl at most
    while await other.try_lock("cost-probe:gpu0", 30.0) is None:
        assert time.monotonic() - killed_at < left_s + 1.0, "the dead holder's lock lingered"
        await asyncio.sleep(0.01)


async def test_a_published_reading_reaches_every_other_replica_once(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a, b, c = [await stores(redis_server, rid) for rid in ("r1", "r2", "r3")]
    sent = reading("r1")
    await a.publish_reading(sent)
    assert await b.fetch_readings() == [sent]  # at once under a fetch
    await eventually(lambda: c.take_readings() == [sent], timeout=3,
                     what="the reading at the next sync")
    await a.publish_reading(sent)  # the same reading again is not taken twice
    later = reading("r2", step_ms=8.0)
    await b.publish_reading(later)
    assert await c.fetch_readings() == [later]
    assert await a.fetch_readings() == [later]  # never one's own
    assert await b.fetch_readings() == []


async def test_a_reading_keeps_its_context_and_an_older_replicas_has_none() -> None:
    sent = reading("r1")
    assert ProbeReading.from_json(sent.to_json()) == sent
    older = ('{"group":"gpu0","pool":"eagle","batch":4.0,"step_ms":9.5,"at":1.0,"by":"r0",'
             '"id":"x"}')
    taken = ProbeReading.from_json(older)
    assert taken is not None and taken.context == 0.0
    assert ProbeReading.from_json(older[:-1] + ',"context":"many"}') is None


async def test_readings_are_capped_and_foreign_entries_ignored(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a, b = await stores(redis_server, "r1"), await stores(redis_server, "r2")
    redis_server.client().xadd("specrouter:probe:readings", {"r": "not json"})
    sent = [reading("r1", step_ms=float(i + 1)) for i in range(40)]
    for r in sent:
        await a.publish_reading(r)
    assert redis_server.client().xlen("specrouter:probe:readings") == 32
    assert await b.fetch_readings() == sent[-32:]
    assert b.status()["connected"]


async def test_with_redis_down_locks_and_readings_fail_fast_and_never_raise_elsewhere(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    redis_server.pause()  # hung: sockets accept, nothing answers
    try:
        started = time.monotonic()
        with pytest.raises(StateUnavailable):
            await a.try_lock("cost-probe:gpu0", 30.0)
        assert time.monotonic() - started < 2.5  # the store's own call timeout
        with pytest.raises(StateUnavailable):  # degraded now: refused at once
            await a.publish_reading(reading("r1"))
        assert a.take_readings() == []
    finally:
        redis_server.resume()
    await eventually(lambda: a.status()["connected"], timeout=5, what="reconnect")
    assert await a.try_lock("cost-probe:gpu0", 30.0) is not None
