"""Redis killed, hung or restarted empty: the request path never notices; the cluster heals."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from specrouter.state import StateUnavailable
from tests.fixtures.procs import eventually
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.anyio


def version_of(store: Any) -> int:
    record = store.get_policy()
    return -1 if record is None else int(record.version)


def request_path_calls(store: Any) -> float:
    """What the router does per request; returns the slowest call's duration in seconds."""
    worst = 0.0
    for _ in range(50):
        t0 = time.perf_counter()
        lease = store.acquire("gpu0/eagle")
        store.cluster_inflight()
        store.get_policy()
        store.status()
        lease.release()
        worst = max(worst, time.perf_counter() - t0)
    return worst


async def test_redis_killed_then_restarted_empty_heals(
    redis_server: RedisServer, stores: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specrouter.state")
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    await a.ensure_policy({"mode": "auto"})
    await a.put_policy({"mode": "tuned"}, expected_version=1)
    a.acquire("gpu0/eagle")
    b.acquire("gpu0/base")
    await eventually(lambda: version_of(b) == 2, what="b at v2")
    await eventually(lambda: a.cluster_inflight() == {"gpu0/eagle": 1, "gpu0/base": 1},
                     what="full view")

    redis_server.kill()
    await eventually(lambda: a.status()["degraded"] and b.status()["degraded"], what="degraded")
    assert request_path_calls(a) < 0.05  # never raises, never waits
    assert a.get_policy().doc == {"mode": "tuned"}  # cached policy still in force
    a.acquire("gpu1/eagle")  # changes while Redis is down are republished later
    with pytest.raises(StateUnavailable):
        await a.put_policy({"mode": "x"})
    with pytest.raises(StateUnavailable):
        await a.audit()
    # Others' last counts are kept no longer than their TTL (Redis would have dropped them).
    await eventually(lambda: a.cluster_inflight() == {"gpu0/eagle": 1, "gpu1/eagle": 1},
                     timeout=5, what="stale peer counts dropped after the TTL")
    status = a.status()
    assert status["connected"] is False and "ConnectionError" in status["last_error"]

    redis_server.start()  # same port, EMPTY: no counts, no policy
    full = {"gpu0/eagle": 1, "gpu1/eagle": 1, "gpu0/base": 1}
    # how soon is the reconnect schedule's business (backoff_max_s); a bound in seconds
    # here would time the shared host, not the store
    await eventually(
        lambda: a.cluster_inflight() == full and b.cluster_inflight() == full,
        timeout=10, what="cluster view whole again",
    )
    raw = redis_server.client().hgetall("specrouter:policy")
    assert raw["version"] == "2" and raw["doc"] == '{"mode":"tuned"}'  # re-seeded, same version
    # the flag clears on the store's next successful round trip, which may come just
    # after the counts that made the view whole
    await eventually(lambda: not a.status()["degraded"], timeout=2, what="a not degraded")
    record = await b.put_policy({"mode": "after"}, expected_version=2)
    assert record.version == 3  # versions continue, never restart at 1
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 2, "one warning per store per transition, not per failure"
    assert sum("is back after" in r.getMessage() for r in caplog.records) == 2


async def test_hung_redis_never_stalls_the_request_path(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    a = await stores(redis_server, "r1")
    b = await stores(redis_server, "r2")
    b.acquire("gpu0/base")
    await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 1}, what="b's count")
    redis_server.pause()  # SIGSTOP: connections accepted, never answered
    try:
        worst = 0.0
        t0 = time.monotonic()
        while not a.status()["degraded"]:
            worst = max(worst, request_path_calls(a))
            assert time.monotonic() - t0 < 10, "a hung Redis was never noticed"
            await asyncio.sleep(0.01)  # let the background loops run between bursts
        assert worst < 0.05, f"request path took {worst * 1000:.1f} ms with Redis hung"
        assert "Timeout" in (a.status()["last_error"] or "")
        t1 = time.monotonic()
        with pytest.raises(StateUnavailable):
            await a.put_policy({"mode": "x"})
        assert time.monotonic() - t1 < 2.0
    finally:
        redis_server.resume()
    await eventually(lambda: not a.status()["degraded"], timeout=10, what="recovery")
    b.acquire("gpu0/base")
    await eventually(lambda: a.cluster_inflight() == {"gpu0/base": 2}, what="live view again")


async def test_start_with_redis_down_serves_locally_then_seeds_the_policy(
    redis_server: RedisServer, stores: Callable[..., Any]
) -> None:
    redis_server.kill()
    t0 = time.monotonic()
    a = await stores(redis_server, "r1")
    assert time.monotonic() - t0 < 3.0  # a down Redis does not hold startup hostage
    record = await a.ensure_policy({"mode": "from-file"})
    assert record.version == 0 and a.status()["degraded"]
    a.acquire("gpu0/eagle")
    assert a.cluster_inflight() == {"gpu0/eagle": 1}
    redis_server.start()
    await eventually(lambda: version_of(a) == 1, timeout=10, what="seeded as v1")
    client = redis_server.client()
    await eventually(lambda: client.hget("specrouter:inflight:r1", "gpu0/eagle") == "1",
                     what="counts published")


async def test_the_password_never_shows_in_status_or_logs(
    redis_factory: Callable[..., RedisServer],
    stores: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "Hunter2-s3cret"
    server = redis_factory(password=secret, user="router")
    caplog.set_level(logging.DEBUG, logger="specrouter.state")
    good = await stores(server, "r1")
    assert good.status()["connected"] and good.status()["url"].startswith("redis://router:***@")
    wrong = await stores(server, "r2", redis_url=server.url().replace(secret, secret + "x"))
    await eventually(lambda: wrong.status()["last_error"] is not None, what="auth failure")
    server.kill()
    await eventually(lambda: good.status()["degraded"], what="degraded")
    server.start()
    await eventually(lambda: not good.status()["degraded"], timeout=10, what="recovery")
    for text in (str(good.status()), str(wrong.status()), caplog.text):
        assert secret not in text
    assert "router:***@" in caplog.text  # the URL is logged, redacted
