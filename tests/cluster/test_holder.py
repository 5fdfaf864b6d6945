"""StorePolicyHolder in process, on real RedisStores sharing one real redis-server: the
compare-and-set retry, 503 while Redis is down, invalid remote documents, history."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from specrouter.control.clusterstate import ClusterState
from specrouter.control.storeholder import StorePolicyHolder
from specrouter.errors import RouterError
from specrouter.routing.policy import Policy
from specrouter.state import StateSettings, make_store
from tests.fixtures.procs import eventually
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.anyio
FAST = {"ttl_s": 1.0, "heartbeat_s": 0.2, "publish_interval_s": 0.01,
        "refresh_interval_s": 0.03, "reconcile_interval_s": 0.3, "backoff_max_s": 0.3}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def cluster_states() -> AsyncIterator[Callable[..., Any]]:
    made: list[ClusterState] = []

    async def make(server: RedisServer, replica_id: str, policy: Policy | None = None,
                   prefix: str = "holder") -> ClusterState:
        settings = StateSettings.model_validate(
            {"redis_url": server.url(), "key_prefix": prefix, **FAST})
        store = make_store(settings, replica_id)
        state = ClusterState(store, policy or Policy())
        made.append(state)
        await state.start()
        return state

    yield make
    for state in made:
        await state.stop()


async def test_shared_policy_wins_over_a_later_replicas_config(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    first = await cluster_states(redis_server, "a", Policy(switch_up=20, switch_down=5))
    second = await cluster_states(redis_server, "b", Policy(switch_up=99, switch_down=1))
    for holder in (first.holder, second.holder):
        assert (holder.current.version, holder.current.switch_up) == (1, 20)


async def test_concurrent_patches_retry_the_merge_and_lose_nothing(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    a = (await cluster_states(redis_server, "a")).holder
    b = (await cluster_states(redis_server, "b")).holder
    # Both merge onto version 1 at once; one CAS wins, the other re-merges onto it.
    results = await asyncio.gather(
        a.patch({"switch_up": 40}, "ra"), b.patch({"eagle_cap": 3}, "rb"),
        a.patch({"switch_down": 2}, "ra"), b.patch({"mode": "eagle"}, "rb"))
    assert sorted(r.new.version for r in results) == [2, 3, 4, 5]
    await eventually(lambda: a.current.version == b.current.version == 5, 3.0, "version 5")
    for holder in (a, b):
        p = holder.current
        assert (p.switch_up, p.eagle_cap, p.switch_down, p.mode) == (40, 3, 2, "eagle")


async def test_invalid_write_is_refused_before_redis(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    from pydantic import ValidationError

    a = (await cluster_states(redis_server, "a")).holder
    with pytest.raises(ValidationError):
        await a.patch({"switch_down": 50})  # >= switch_up
    assert redis_server.client().hget("holder:policy", "version") == "1"
    assert a.current.version == 1


async def test_redis_down_answers_503_and_keeps_the_policy(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    state = await cluster_states(redis_server, "a")
    redis_server.kill()
    await eventually(lambda: bool(state.store.status()["degraded"]), 5.0, "degraded")
    with pytest.raises(RouterError) as refused:
        await state.holder.patch({"switch_up": 30})
    assert refused.value.status == 503
    body = json.loads(refused.value.body())
    assert body["error"]["code"] == "state_unavailable"
    assert "unchanged" in body["error"]["message"]
    assert state.holder.current.switch_up == 16
    await eventually(lambda: state.status()["degraded_transitions"] >= 1, 2.0, "counted")


async def test_invalid_remote_document_is_ignored(
    redis_server: RedisServer, cluster_states: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = (await cluster_states(redis_server, "a")).holder
    seen: list[tuple[int, int]] = []
    a.subscribe(lambda old, new: seen.append((old.version, new.version)))
    r = redis_server.client()
    r.hset("holder:policy", mapping={"doc": json.dumps({"mode": "sometimes"}), "version": 2,
                                     "updated_at": time.time(), "updated_by": "x"})
    r.publish("holder:policy:changed", 2)
    await eventually(lambda: "policy version 2 from the state store is invalid" in caplog.text,
                     3.0, "the invalid doc to be seen and refused")
    assert "mode: Input should be" in caplog.text
    assert a.current.version == 1 and seen == []
    change = await a.patch({"switch_up": 30})
    assert (change.old.version, change.new.version) == (1, 3)
    assert seen == [(1, 3)]


async def test_history_comes_from_the_cluster_audit_log(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    a = (await cluster_states(redis_server, "a")).holder
    b: StorePolicyHolder = (await cluster_states(redis_server, "b")).holder
    await a.patch({"switch_up": 30}, "admin-a")
    await a.patch({"switch_up": 31}, "admin-a")
    await eventually(lambda: [c.new.version for c in b.history()][:2] == [3, 2], 3.0,
                     "b's history to hold a's writes")
    newest = b.history()[0]
    assert (newest.old.switch_up, newest.new.switch_up, newest.actor) == (30, 31, "admin-a")


async def test_stop_is_prompt_and_the_withdraw_sticks(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    """Regression: on Python 3.11 a cancellation could be swallowed inside redis-py's send,
    leaving the publish loop running after close(): a 2 s stall, then counts re-published."""
    state = await cluster_states(redis_server, "gone")
    lease = state.store.acquire("gpu0-eagle")
    await state.store.audit(5)  # stop right after Redis calls, with publishes in flight
    r = redis_server.client()
    started = time.monotonic()
    await state.stop()
    assert time.monotonic() - started < 1.0
    lease.release()  # a late release after close must not bring the counts back
    watch_until = time.monotonic() + 0.3  # several publish intervals of the stopped store
    while time.monotonic() < watch_until:
        assert r.exists("holder:inflight:gone") == 0
        assert r.zscore("holder:replicas", "gone") is None
        await asyncio.sleep(0.02)


async def test_a_replica_that_skipped_versions_logs_what_each_write_replaced(
    redis_server: RedisServer, cluster_states: Callable[..., Any]
) -> None:
    """A replica that starts at version 3 never saw version 2: its history must not say that
    version 3 replaced its own start-up policy; it reads the writes from the audit log."""
    a = (await cluster_states(redis_server, "a")).holder
    await a.patch({"switch_up": 30}, "admin-a")
    await a.patch({"switch_up": 31}, "admin-a")
    b: StorePolicyHolder = (await cluster_states(redis_server, "b")).holder
    assert all(c.new.version == c.old.version + 1 for c in b.history())
    await eventually(lambda: [c.new.version for c in b.history()][:2] == [3, 2], 3.0,
                     "b's history to hold a's writes")
    newest = b.history()[0]
    assert (newest.old.switch_up, newest.new.switch_up) == (30, 31)
