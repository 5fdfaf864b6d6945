"""Cost probes of two `specrouter serve` replicas starting together on one real
`redis-server`, in front of one simulated H200 group: the group's cluster-wide lock puts
one probe at a time on its GPUs, and one probe per pool serves both replicas (the one that
did not probe folds in the other's published reading).

The engines sit behind a counting proxy that sees every probe generation (their rid
starts with `PROBE_RID_PREFIX`): how many run at once on the group, and how many ran.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn

from specrouter.proxy.shadow import PROBE_RID_PREFIX
from tests.fixtures.procs import free_port, wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory, RouterProc
from tests.fixtures.sim import SimGroup

PROFILE = "h200-llama3-8b"
_MARK = f'"rid":"{PROBE_RID_PREFIX}'.encode()


@dataclass
class ProbeCount:
    """Probe generations at the group's engines: now, at most at once, in all (per pool)."""

    now: int = 0
    peak: int = 0
    total: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self, pool: str) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.total[pool] = self.total.get(pool, 0) + 1

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


class CountingProxy:
    """An ASGI relay to one engine that counts the probe generations it forwards."""

    def __init__(self, upstream: str, pool: str, count: ProbeCount) -> None:
        self.upstream, self.pool, self.count = upstream, pool, count
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        probe = scope["path"] == "/generate" and _MARK in body
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=120.0)
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        if probe:
            self.count.enter(self.pool)
        try:
            answer = await self.client.request(
                scope["method"], f"{self.upstream}{scope['path']}", content=body,
                headers=headers, params=scope["query_string"].decode())
        finally:
            if probe:
                self.count.leave()
        out = [(k.encode(), v.encode()) for k, v in answer.headers.items()
               if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")]
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": [*out, (b"content-length", str(len(answer.content)).encode())]})
        await send({"type": "http.response.body", "body": answer.content})


@pytest.fixture
def counted_group(sim_group: Any) -> Iterator[tuple[dict[str, str], ProbeCount]]:
    """A real-time simulated group behind counting proxies: ({pool: url}, count)."""
    sim: SimGroup = sim_group(profile=PROFILE, time_scale=1.0)
    count = ProbeCount()
    urls, servers, threads = {}, [], []
    for pool in ("eagle", "baseline"):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(
            CountingProxy(sim.url(pool), pool, count), host="127.0.0.1", port=port,
            log_level="warning", lifespan="off"))
        thread = threading.Thread(target=lambda s=server: asyncio.run(s.serve()), daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        urls[pool] = f"http://127.0.0.1:{port}"
    wait_until(lambda: all(s.started for s in servers), 10.0, "the counting proxies")
    yield urls, count
    for server in servers:
        server.should_exit = True
    for thread in threads:
        thread.join(10)


def _backends(urls: dict[str, str]) -> list[dict[str, str]]:
    """The counted group's two servers as the router's backends."""
    return [{"name": f"gpu0-{pool}", "url": urls[pool], "pool": pool, "group": "gpu0"}
            for pool in ("eagle", "baseline")]


def _learned(proc: RouterProc) -> dict[str, Any]:
    group: dict[str, Any] = httpx.get(f"{proc.url}/policy", timeout=5.0).json()["groups"][0]
    learned: dict[str, Any] = group["learned"]
    return learned


def test_replicas_starting_together_probe_each_pool_once_one_at_a_time(
    redis_server: RedisServer, counted_group: tuple[dict[str, str], ProbeCount],
    router: RouterFactory,
) -> None:
    urls, count = counted_group
    backends = _backends(urls)
    env = {
        "SPECROUTER_REDIS_URL": redis_server.url(),
        "SPECROUTER_STATE": json.dumps({"key_prefix": "probelock"}),
        # one generation a probe round, ~1.8 s long at this profile's 7 ms step: two
        # replicas starting together would overlap without the lock
        "SPECROUTER_COST_PROBE": json.dumps({
            "prompt_tokens": 16, "tokens": 256, "eagle_batches": [1],
            "baseline_batches": [1], "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1}),
    }
    with ThreadPoolExecutor(2) as pool:  # each returns once its start-up probes are done
        replicas = list(pool.map(lambda _: router(backends, env=env), range(2)))
    models = [_learned(r) for r in replicas]
    assert count.peak == 1, (count, models)
    # one probe a pool (a warm-up, a short and a long generation) served both replicas
    assert count.total == {"baseline": 3, "eagle": 3}, (count, models)
    for p in ("baseline", "eagle"):
        outcomes = sorted((m["probes"].get(f"{p}/read", 0), m["probes"].get(f"{p}/shared", 0))
                          for m in models)
        assert outcomes == [(0, 1), (1, 0)], models  # read by one, shared with the other
    assert all(m["pools"][p]["readings"] >= 1 for m in models for p in ("baseline", "eagle"))


def test_with_redis_unreachable_a_replica_still_probes_on_its_own(
    counted_group: tuple[dict[str, str], ProbeCount], router: RouterFactory,
) -> None:
    urls, count = counted_group
    backends = _backends(urls)
    proc = router(backends, env={
        "SPECROUTER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens
        "SPECROUTER_COST_PROBE": json.dumps({
            "prompt_tokens": 16, "tokens": 32, "eagle_batches": [1], "baseline_batches": [1],
            "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})})
    learned = _learned(proc)  # start-up returned: its probes ran, none hung
    assert learned["probes"] == {"baseline/read": 1, "eagle/read": 1}, learned
    assert count.total == {"baseline": 3, "eagle": 3}
    assert proc.ready()["state"]["degraded"]


def test_the_lock_of_a_replica_killed_mid_probe_expires_and_another_probes(
    redis_server: RedisServer, counted_group: tuple[dict[str, str], ProbeCount],
    router: RouterFactory,
) -> None:
    urls, count = counted_group
    backends = _backends(urls)

    def env(tokens: int, timeout_s: float) -> dict[str, str]:
        return {
            "SPECROUTER_REDIS_URL": redis_server.url(),
            "SPECROUTER_STATE": json.dumps({"key_prefix": "probelock"}),
            "SPECROUTER_COST_PROBE": json.dumps({
                "prompt_tokens": 16, "tokens": tokens, "eagle_batches": [1],
                "baseline_batches": [1], "check_s": 0.1, "startup_wait_s": 0,
                "timeout_s": timeout_s}),
            "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})}

    # the victim's long round runs ~3.6 s; its lock lives 2 + 4 s
    victim = router(backends, env=env(512, 2.0))
    # the warm-up, the short round, then the long one
    wait_until(lambda: count.total.get("baseline", 0) >= 3, 20.0, "the victim's long round")
    survivor = router(backends, env=env(32, 30.0))
    key, client = "probelock:lock:cost-probe:gpu0", redis_server.client()
    token, ttl_ms = client.get(key), client.pttl(key)
    assert token is not None and 0 < ttl_ms <= 6000, (token, ttl_ms)
    victim.process.signal(9)
    wait_until(lambda: client.get(key) != token, 6.5, "the dead holder's lock to expire")
    # the survivor had not probed while the dead replica's lock lived
    assert not _learned(survivor)["probes"].get("baseline/read")
    wait_until(lambda: {"baseline/read", "eagle/read"} <= set(_learned(survivor)["probes"]),
               20.0, "the survivor's own probes")
    assert count.peak == 1, count
