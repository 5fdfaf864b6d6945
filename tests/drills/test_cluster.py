"""Cluster drills: router replicas sharing one real redis-server in front of one simulated
group. Redis slow (SIGSTOP), killed and restarted empty under load: no request fails or
stalls; a replica SIGKILLed mid-load: its own clients see errors, the others' requests all
finish; a replica stopped with SIGTERM drains and withdraws its counts from Redis."""

from __future__ import annotations

import asyncio
import signal
import time

from loadtest import loopback
from tests.cluster.conftest import MODEL, Cluster, ClusterFactory, replicas  # noqa: F401
from tests.drills.conftest import Outcome, call
from tests.fixtures.procs import wait_until

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "stream": True, "ignore_eos": True}


async def _load_until(urls: list[str], stop: asyncio.Event, outcomes: list[Outcome],
                      latencies: list[float], per_url: int = 2) -> None:
    async with loopback.async_client(timeout=30.0) as client:
        async def worker(url: str) -> None:
            while not stop.is_set():
                began = time.monotonic()
                outcomes.append(await call(client, f"{url}/v1/chat/completions", BODY))
                latencies.append(time.monotonic() - began)
        await asyncio.gather(*(worker(u) for u in urls for _ in range(per_url)))


def _zero_everywhere(c: Cluster) -> None:
    try:
        c.wait_all(lambda r: not any(r.local_inflight().values())
                   and not any(r.cluster_inflight().values()), 15.0,
                   "local and cluster in-flight back to zero on every replica")
    except TimeoutError as exc:
        seen = [(r.local_inflight(), r.cluster_inflight(), r.state(),
                 r.proc.process.output()[-4000:]) for r in c.replicas]
        raise AssertionError(f"{exc}: (local, cluster, state, log) per replica: {seen}") from None


def test_redis_slow_killed_restarted_empty_under_load_nothing_lost(
    replicas: ClusterFactory,  # noqa: F811
) -> None:
    c = replicas(count=2, time_scale=0.05)
    outcomes: list[Outcome] = []
    latencies: list[float] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load_until([r.url for r in c.replicas], stop, outcomes,
                                                 latencies))

        def served_more(n: int) -> None:
            mark = len(outcomes)
            wait_until(lambda: len(outcomes) >= mark + n or load.done(), 20.0,
                       f"{n} more requests served")

        await asyncio.to_thread(served_more, 10)
        c.redis.pause()  # slow: accepts connections, answers nothing
        await asyncio.to_thread(served_more, 20)
        c.redis.resume()
        c.redis.kill()
        await asyncio.to_thread(served_more, 20)
        c.redis.start()  # back, empty
        await asyncio.to_thread(c.wait_all, lambda r: r.state()["connected"], 20.0,
                                "every replica reconnected")
        await asyncio.to_thread(served_more, 10)
        stop.set()
        await load

    asyncio.run(scenario())
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], failed[:5]
    assert max(latencies) < 5.0, max(latencies)  # a hung Redis never stalls a request
    _zero_everywhere(c)
    # The empty Redis got the policy back (re-seeded) and the replicas' heartbeats.
    assert c.redis.client().exists(f"{c.prefix}:policy")


def test_replica_killed_mid_load_its_clients_see_errors_others_carry_on(
    replicas: ClusterFactory,  # noqa: F811
) -> None:
    c = replicas(count=3, time_scale=0.2)
    long_body = {**BODY, "max_tokens": 400}

    async def scenario() -> tuple[list[Outcome | BaseException], list[Outcome]]:
        async with loopback.async_client(timeout=60.0) as client:
            on_victim = [asyncio.ensure_future(call(client, f"{c[0].url}/v1/chat/completions",
                                                    long_body, timeout=60.0))
                         for _ in range(2)]
            on_others = [asyncio.ensure_future(call(client, f"{r.url}/v1/chat/completions",
                                                    long_body, timeout=60.0))
                         for r in c.replicas[1:] for _ in range(2)]
            await asyncio.to_thread(c.wait_all, lambda r: sum(r.cluster_inflight().values())
                                    == 6, 20.0, "all six streams in every view")
            c[0].proc.process.signal(signal.SIGKILL)
            victim = await asyncio.gather(*on_victim, return_exceptions=True)
            others = await asyncio.gather(*on_others)
            return victim, others

    victim, others = asyncio.run(scenario())
    # The killed replica's clients got a transport error: the connection dropped mid-stream.
    assert all(isinstance(v, AssertionError) and "cut" in str(v) for v in victim), victim
    assert all(o.ok for o in others), others
    survivors = c.replicas[1:]
    c.replicas = survivors
    # Its counts leave the others' view once its lease expires (ttl_s = 1 s).
    _zero_everywhere(c)
    after = asyncio.run(_short_load([r.url for r in survivors]))
    assert all(o.ok for o in after), after


async def _short_load(urls: list[str]) -> list[Outcome]:
    async with loopback.async_client(timeout=30.0) as client:
        return list(await asyncio.gather(*(call(client, f"{u}/v1/chat/completions", BODY)
                                           for u in urls for _ in range(3))))


def test_sigterm_on_a_replica_drains_and_withdraws_its_counts(
    replicas: ClusterFactory,  # noqa: F811
) -> None:
    c = replicas(count=2, time_scale=1.0, ttl_s=30.0)  # a long TTL: only a withdraw clears
    leaving = c[0]
    replica_id = leaving.state()["replica_id"]

    async def scenario() -> Outcome:
        async with loopback.async_client(timeout=60.0) as client:
            stream = asyncio.ensure_future(call(client, f"{leaving.url}/v1/chat/completions",
                                                {**BODY, "max_tokens": 100}, timeout=60.0))
            await asyncio.to_thread(wait_until, lambda: sum(c[1].cluster_inflight().values())
                                    == 1, 20.0, "the stream in the other replica's view")
            leaving.proc.process.signal(signal.SIGTERM)
            return await stream

    outcome = asyncio.run(scenario())
    assert outcome.ok, outcome  # the drain let it finish
    proc = leaving.proc.process.proc
    assert proc is not None
    proc.wait(20)
    redis = c.redis.client()
    assert not redis.exists(f"{c.prefix}:inflight:{replica_id}")
    wait_until(lambda: not any(c[1].cluster_inflight().values()), 10.0,
               "the other replica's view to drop the leaver's counts")
