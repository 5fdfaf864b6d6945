"""One load view for three replicas: the overflow cap holds across replicas, a burst stays
within the documented overshoot bound (docs/state.md), and a replica killed with SIGKILL has
its counts gone from the others' view within the TTL."""

from __future__ import annotations

import asyncio
import random
import signal
import time

from loadtest import loopback
from tests.cluster.conftest import Cluster, ClusterFactory, Held, in_thread
from tests.fixtures.departures import leave_all, random_departures
from tests.fixtures.procs import wait_until

CAP = 4
OVERFLOW = {"strategy": "overflow", "eagle_cap": CAP, "load_signal": "inflight"}


def _converged(c: Cluster, total: int) -> None:
    """Every replica's cluster view shows `total` requests in flight."""
    c.wait_all(lambda r: sum(r.cluster_inflight().values()) == total, 10.0,
               f"every replica's cluster view at {total} in flight")


def _eagle_engine_load(c: Cluster) -> int:
    state = c.group.state("eagle")
    return int(state["running"]) + int(state["waiting"])


def test_eagle_cap_holds_across_replicas(replicas: ClusterFactory) -> None:
    c = replicas(policy=OVERFLOW)

    async def scenario() -> None:
        held = Held()
        try:
            # One at a time, round robin, each once the views agree: exactly CAP go to EAGLE-3
            # in total (each replica alone would admit CAP of its own: 3 * CAP).
            pools = []
            for i in range(3 * CAP - 3):
                pools.append(await held.open(c[i % 3].url))
                await in_thread(_converged, c, i + 1)
            assert pools == ["eagle"] * CAP + ["baseline"] * (2 * CAP - 3), pools
            assert c[0].cluster_inflight() == {"gpu0-eagle": CAP,
                                               "gpu0-baseline": 2 * CAP - 3}
            assert f'specrouter_cluster_inflight_requests{{backend="gpu0-eagle"}} {CAP}.0' in (
                c[1].metrics())
            # The engine agrees: CAP requests of the router on the EAGLE-3 server.
            await in_thread(wait_until, lambda: _eagle_engine_load(c) == CAP, 10.0,
                            "the EAGLE engine running CAP requests")
        finally:
            await held.aclose()
        await in_thread(_converged, c, 0)

        # A burst at one instant over the three replicas: within the documented bound,
        # at most CAP admitted by each replica (cap + (R - 1) * cap from an idle cluster).
        burst = Held()
        try:
            results = await asyncio.gather(*(burst.open(c[i % 3].url) for i in range(12)))
            eagle = results.count("eagle")
            assert CAP <= eagle <= 3 * CAP, results
            await in_thread(_converged, c, 12)
            # Once the views converged every replica sees the cap reached.
            for r in c.replicas:
                assert await burst.open(r.url) == "baseline"
            engine = await in_thread(_eagle_engine_load, c)
            assert engine == eagle
            print(f"burst of 12 over 3 replicas: {eagle} admitted to EAGLE-3 (cap {CAP})")
        finally:
            await burst.aclose()

    asyncio.run(scenario())
    _converged(c, 0)


def test_sigkilled_replica_counts_vanish_within_ttl(replicas: ClusterFactory) -> None:
    ttl = 1.0
    c = replicas(ttl_s=ttl)

    async def scenario() -> None:
        held = Held()
        try:
            await held.open(c[0].url)
            for _ in range(3):
                await held.open(c[2].url)
            await in_thread(_converged, c, 4)
            c[2].proc.process.signal(signal.SIGKILL)
            killed = time.monotonic()
            survivors = c.replicas[:2]
            await in_thread(
                wait_until,
                lambda: all(sum(r.cluster_inflight().values()) == 1 for r in survivors),
                ttl + 5.0, "the killed replica's counts to leave the survivors' view")
            gone_after = time.monotonic() - killed
            print(f"SIGKILLed replica's counts gone after {gone_after:.2f} s (ttl {ttl} s)")
            # TTL, plus one refresh of the view and one /ready poll of this test.
            assert gone_after <= ttl + 0.5, gone_after
            for r in survivors:
                assert r.state()["replicas_seen"] == 2
        finally:
            await held.aclose()

    asyncio.run(scenario())
    c.replicas = c.replicas[:2]
    _converged(c, 0)


def test_every_request_path_releases_its_count(replicas: ClusterFactory) -> None:
    """Retried 503s, streams cut by the engine and client disconnects all leave the cluster
    counts at zero: in every replica's view and in Redis itself."""
    c = replicas(policy={"allow_client_override": True}, time_scale=0.05)
    c.group.control("eagle", error_rate=1.0, error_status=503)
    c.group.control("baseline", cut_stream_after_tokens=3)

    async def scenario() -> None:
        async with loopback.async_client(timeout=30.0) as client:
            async def ask(i: int) -> tuple[int, str, bytes]:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 16, "stream": i % 2 == 1, "ignore_eos": True}
                response = await client.post(f"{c[i % 3].url}/v1/chat/completions", json=body,
                                             headers={"x-specrouter-pool": "eagle"})
                return response.status_code, response.headers.get(
                    "x-specrouter-backend", ""), response.content

            answers = await asyncio.gather(*(ask(i) for i in range(12)))
        for status, backend, content in answers:
            # EAGLE answered 503: retried on the baseline, which then cut the stream.
            assert backend == "gpu0-baseline", (status, backend, content[:200])
        assert any(b"backend closed the stream" in content or b"error" in content
                   for _, _, content in answers)
        held = Held()
        try:
            c.group.control("baseline", cut_stream_after_tokens=None)
            for r in c.replicas:
                await held.open(r.url)
            await in_thread(_converged, c, 3)
        finally:
            await held.aclose()  # client disconnects

    asyncio.run(scenario())
    _converged(c, 0)
    redis = c.redis.client()
    wait_until(lambda: not list(redis.scan_iter(f"{c.prefix}:inflight:*")), 5.0,
               "no in-flight hash left in redis")


def test_clients_leaving_anywhere_leave_no_count_in_the_cluster(replicas: ClusterFactory) -> None:
    """Clients leaving at any point of their requests (tests/fixtures/departures.py), spread
    over three replicas of a group that switches pools with its load: every replica's
    cluster view and Redis end with nothing in flight."""
    c = replicas(policy={"strategy": "threshold", "switch_up": 3, "switch_down": 1,
                         "load_signal": "inflight"}, time_scale=0.05)
    rng = random.Random(11)
    ports = [int(r.url.rsplit(":", 1)[1]) for r in c.replicas]

    for _ in range(3):
        asyncio.run(leave_all(ports, random_departures(rng, 24)))
    _converged(c, 0)
    assert not any(c.total_local().values()), c.total_local()
    redis = c.redis.client()
    wait_until(lambda: not list(redis.scan_iter(f"{c.prefix}:inflight:*")), 5.0,
               "no in-flight hash left in redis")
    for r in c.replicas:
        assert "Traceback" not in r.proc.process.output(), r.proc.process.output()[-3000:]
