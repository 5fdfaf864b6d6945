"""In-flight counts shared through a real redis-server: sums, exactness, TTL on crash, prefixes."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures.procs import ManagedProcess, eventually
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.anyio


async def test_counts_sum_over_replicas_and_local_counts_are_exact(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a, b, c = [await stores(redis_server, rid) for rid in ("r1", "r2", "r3")]
    leases = [a.acquire("gpu0/eagle") for _ in range(3)] + [b.acquire("gpu0/eagle")]
    c.acquire("gpu1/base")
    expected = {"gpu0/eagle": 4, "gpu1/base": 1}
    for store in (a, b, c):
        await eventually(lambda s=store: s.cluster_inflight() == expected, what="summed view")
    # My own change is visible at once, before any publish/refresh: local counts are exact.
    a.acquire("gpu1/base")
    assert a.cluster_inflight()["gpu1/base"] == 2
    assert a.local_inflight() == {"gpu0/eagle": 3, "gpu1/base": 1}
    for lease in leases:
        lease.release()
    a.release("gpu1/base")
    for store in (a, b, c):
        await eventually(lambda s=store: s.cluster_inflight() == {"gpu1/base": 1}, what="drain")
    assert a.status()["replicas_seen"] == 3


async def test_counts_never_go_negative_across_the_cluster(
    redis_server: RedisServer, stores: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    b.acquire("gpu0/eagle")
    with caplog.at_level(logging.WARNING, logger="specrouter.state"):
        a.release("gpu0/eagle")  # more releases than acquires on r1: a caller bug
        a.release("gpu0/eagle")
    assert "below zero" in caplog.text
    assert a.local_inflight() == {}
    # r1's bug cannot eat r2's count: each replica publishes only its own counts.
    await eventually(lambda: a.cluster_inflight() == {"gpu0/eagle": 1}, what="r2's count")
    raw = redis_server.client().hgetall("specrouter:inflight:r1")
    assert all(int(v) >= 0 for v in raw.values())


async def test_a_closed_replica_withdraws_its_counts_at_once(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1", ttl_s=30.0, heartbeat_s=1.0)
    b = await stores(redis_server, "r2", ttl_s=30.0, heartbeat_s=1.0)
    a.acquire("gpu0/eagle")
    await eventually(lambda: b.cluster_inflight() == {"gpu0/eagle": 1}, what="a's count")
    await a.close()
    # Far sooner than the 30 s TTL: close() deleted the hash.
    await eventually(lambda: b.cluster_inflight() == {}, timeout=3, what="withdrawal")


VICTIM = """
import asyncio, os
from specrouter.state import StateSettings, make_store

async def main():
    store = make_store(StateSettings(redis_url=os.environ["VICTIM_REDIS_URL"], ttl_s=1.0,
                                     heartbeat_s=0.2), "victim")
    await store.start()
    for _ in range(5):
        store.acquire("gpu0/eagle")
    print("acquired", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_replica_killed_with_sigkill_has_its_counts_gone_within_the_ttl(
    redis_server: RedisServer,
    stores: Callable[..., Any],
    process_factory: list[ManagedProcess],
) -> None:
    observer = await stores(redis_server, "observer")
    observer.acquire("gpu0/eagle")
    victim = ManagedProcess(
        [sys.executable, "-c", VICTIM], env={"VICTIM_REDIS_URL": redis_server.url()}
    ).start()
    process_factory.append(victim)
    await eventually(
        lambda: observer.cluster_inflight().get("gpu0/eagle") == 6,
        timeout=30, what=f"the victim's counts; its output:\n{victim.output()}",
    )
    assert redis_server.client().pttl("specrouter:inflight:victim") > 0
    victim.signal(signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait(10)
    gone_after = await eventually(
        lambda: observer.cluster_inflight() == {"gpu0/eagle": 1},
        timeout=10, what="the dead replica's counts to expire",
    )
    assert gone_after <= 1.0 + 0.5, f"counts lingered {gone_after:.2f}s for a 1 s TTL"
    assert not redis_server.client().exists("specrouter:inflight:victim")


async def test_counts_of_a_live_replica_survive_many_ttls(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")  # ttl 1 s, heartbeat 0.2 s
    b = await stores(redis_server, "r2")
    a.acquire("gpu0/eagle")  # then no change at all: only the heartbeat keeps it alive
    await eventually(lambda: b.cluster_inflight() == {"gpu0/eagle": 1}, what="a's count")
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert b.cluster_inflight() == {"gpu0/eagle": 1}
        await asyncio.sleep(0.05)  # sampling the view over 2.5 TTLs, not waiting for an event


async def test_key_prefixes_isolate_clusters_sharing_one_redis(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    blue = await stores(redis_server, "r1", key_prefix="blue")
    green = await stores(redis_server, "r1", key_prefix="green")  # same replica id, no clash
    green_peer = await stores(redis_server, "r2", key_prefix="green")
    blue.acquire("gpu0/eagle")
    green.acquire("gpu0/base")
    await blue.ensure_policy({"cluster": "blue"})
    await green.ensure_policy({"cluster": "green"})
    await eventually(lambda: green_peer.cluster_inflight() == {"gpu0/base": 1}, what="green")
    peer_policy = green_peer.get_policy
    await eventually(lambda: peer_policy() is not None, what="green policy")
    assert green_peer.get_policy().doc == {"cluster": "green"}
    assert blue.cluster_inflight() == {"gpu0/eagle": 1}
    keys = redis_server.client().keys("*")
    assert keys and all(k.startswith(("blue:", "green:")) for k in keys)
