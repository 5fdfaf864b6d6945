"""Redis killed mid-load: zero failed client requests (openai client streaming through all three
replicas), /ready and /metrics say degraded, admin writes answer 503 and change nothing; Redis
restarted empty: the cluster view is whole again and the policy re-seeded within 2 s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.conftest import MODEL, Cluster, ClusterFactory, Held, Replica, in_thread
from tests.fixtures.departures import leave_all, random_departures
from tests.fixtures.procs import wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory

# Held streams go to the baseline, the background load to EAGLE-3 (client override), so the
# baseline's cluster count is a stable witness of how whole each replica's view is.
POLICY = {"allow_client_override": True}


@dataclass
class Load:
    """Short streaming chat requests through every replica until stopped."""

    cluster: Cluster
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, replica: Replica) -> None:
        client = openai.AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="none",
                                    max_retries=0, timeout=30.0)
        try:
            while not self.stop.is_set():
                try:
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}],
                        max_tokens=8, stream=True, extra_body={"ignore_eos": True},
                        extra_headers={"x-specrouter-pool": "eagle"})
                    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                                    if chunk.choices])
                    assert text, "empty completion"
                    self.ok += 1
                except Exception as exc:  # every failure counts, whatever its kind
                    self.failures.append(f"{replica.url}: {type(exc).__name__}: {exc}")
        finally:
            await client.close()


def _metric(replica: Replica, name: str) -> float:
    for family in text_string_to_metric_families(replica.metrics()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not in /metrics")


def _baseline_everywhere(c: Cluster, expected: int) -> bool:
    return all(r.cluster_inflight()["gpu0-baseline"] == expected for r in c.replicas)


def test_redis_killed_mid_load_then_restarted_empty(replicas: ClusterFactory) -> None:
    c = replicas(policy=POLICY, ttl_s=1.0)
    assert _metric(c[0], "specrouter_state_connected") == 1.0

    async def scenario() -> None:
        held = Held()
        load = Load(c)
        workers = [asyncio.create_task(load.run(r)) for r in c.replicas for _ in range(2)]
        try:
            for r in c.replicas:
                assert await held.open(r.url, pool="baseline") == "baseline"
            await in_thread(wait_until, lambda: _baseline_everywhere(c, 3), 10.0,
                            "each replica seeing the 3 held baseline streams")
            await in_thread(wait_until, lambda: load.ok >= 6, 30.0, "load flowing")

            # -- Redis dies mid-load ---------------------------------------------------------
            c.redis.kill()
            served_before = load.ok
            await in_thread(c.wait_all, lambda r: r.state()["degraded"], 10.0,
                            "every replica reporting degraded")
            for r in c.replicas:
                ready = r.ready()
                assert ready["ready"] is True  # a degraded store never makes /ready fail
                assert ready["state"]["connected"] is False
                assert _metric(r, "specrouter_state_degraded") == 1.0
                assert _metric(r, "specrouter_state_connected") == 0.0
                assert _metric(r, "specrouter_state_degraded_transitions_total") >= 1.0
            # An admin write needs Redis: 503 in the OpenAI format, the old policy stays.
            refused = c[1].write("PATCH", {"switch_up": 99})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "state_unavailable"
            assert {r.policy()["policy"]["switch_up"] for r in c.replicas} == {16}
            # After the TTL the others' counts are dropped: each replica on its own view.
            await in_thread(wait_until, lambda: _baseline_everywhere(c, 1), 10.0,
                            "each replica falling back to its own counts")
            await in_thread(wait_until, lambda: load.ok >= served_before + 6, 30.0,
                            "requests served while redis is down")

            # -- Redis comes back empty ------------------------------------------------------
            await in_thread(c.redis.start)
            restarted = time.monotonic()
            version = c[0].version()
            redis = c.redis.client()

            def whole() -> bool:  # one /ready per replica: the poll itself must be cheap
                if redis.hget(f"{c.prefix}:policy", "version") != str(version):
                    return False
                for r in c.replicas:
                    ready = r.ready()
                    if not (ready["state"]["connected"]
                            and ready["cluster_inflight"]["gpu0-baseline"] == 3):
                        return False
                return True

            await in_thread(wait_until, whole, 10.0, "cluster view whole, policy re-seeded")
            took = time.monotonic() - restarted
            print(f"redis restarted empty: view whole and policy re-seeded after {took:.2f} s; "
                  f"{load.ok} requests served, {len(load.failures)} failed")
            assert took < 2.0, took
            for r in c.replicas:
                assert _metric(r, "specrouter_state_degraded") == 0.0
                log = r.proc.process.output()  # one warning per transition, both ways
                assert log.count("serving from the local view until it is back") == 1, log
                assert log.count("is back after") == 1, log
            # Writes work again and continue the version sequence.
            answer = c[2].write("PATCH", {"switch_up": 24})
            assert answer.status_code == 200, answer.text
            assert answer.json()["policy"]["version"] == version + 1
        finally:
            load.stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*workers), 60.0)
            await held.aclose()
        assert load.failures == [], load.failures[:5]
        assert load.ok > 0

    asyncio.run(scenario())


def test_router_starts_with_redis_down_and_seeds_it_when_it_appears(
    sim_group: Any, router: RouterFactory
) -> None:
    group = sim_group(time_scale=0.05)
    backends = [{"name": f"gpu0-{pool}", "url": group.url(pool), "pool": pool, "group": "gpu0"}
                for pool in ("eagle", "baseline")]
    redis = RedisServer()  # not started yet: its port is closed
    try:
        proc = router(backends, env={"SPECROUTER_REDIS_URL": redis.url(),
                                     "SPECROUTER_POLICY": json.dumps({"switch_up": 21}),
                                     "SPECROUTER_STATE": json.dumps({"backoff_max_s": 0.3})})
        replica = Replica(proc)
        ready = replica.ready()
        assert ready["ready"] is True and ready["state"]["degraded"] is True
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content
        assert replica.policy()["policy"]["switch_up"] == 21

        redis.start()
        wait_until(lambda: replica.state()["connected"], 10.0, "the router connecting")
        stored = redis.client().hgetall("specrouter:policy")
        assert stored["version"] == "1" and json.loads(stored["doc"])["switch_up"] == 21
        assert replica.version() == 1
    finally:
        redis.stop()


def test_counts_of_clients_leaving_across_a_redis_outage_end_at_zero(
        replicas: ClusterFactory) -> None:
    """Clients leaving at every point of their requests (tests/fixtures/departures.py)
    before, during and after a Redis outage, over three replicas: once Redis is back,
    every replica's cluster view, every local count and Redis itself are at zero."""
    c = replicas(policy=POLICY, ttl_s=1.0, time_scale=0.05)
    rng = random.Random(5)
    ports = [int(r.url.rsplit(":", 1)[1]) for r in c.replicas]

    asyncio.run(leave_all(ports, random_departures(rng, 18)))
    c.redis.kill()
    c.wait_all(lambda r: r.state()["degraded"], 10.0, "every replica reporting degraded")
    asyncio.run(leave_all(ports, random_departures(rng, 18)))
    c.redis.start()
    c.wait_all(lambda r: r.state()["connected"], 10.0, "every replica connected again")
    asyncio.run(leave_all(ports, random_departures(rng, 18)))
    c.wait_all(lambda r: sum(r.cluster_inflight().values()) == 0, 10.0,
               "every replica's cluster view at zero")
    assert not any(c.total_local().values()), c.total_local()
    redis = c.redis.client()
    wait_until(lambda: not list(redis.scan_iter(f"{c.prefix}:inflight:*")), 5.0,
               "no in-flight hash left in redis")
    for r in c.replicas:
        output = r.proc.process.output()
        assert "Traceback" not in output, output[-3000:]
