"""Three `specrouter serve` replicas sharing one real `redis-server`, in front of one simulated
GPU group (an EAGLE-3 and a baseline engine from `specrouter sim`).

`replicas(policy=..., ttl_s=...)` starts them. Each replica is a separate process with its own
replica id; they share policy and in-flight counts only through Redis. Health checks are fast
and the store's TTL short so fault tests finish in seconds; the sim runs in real time so a
long streaming request stays open for as long as a test holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory, RouterProc
from tests.fixtures.sim import SimGroup

ADMIN_TOKEN = "cluster-admin-token-77e1"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FAST_HEALTH = {"interval_s": 0.2, "ready_timeout_s": 1.0, "health_timeout_s": 1.0}
BACKENDS = ("gpu0-eagle", "gpu0-baseline")
LONG = 4000  # tokens: tens of seconds at the sim's real-time pace


def get_json(url: str) -> dict[str, Any]:
    result: dict[str, Any] = loopback.get(url, timeout=5.0).json()
    return result


@dataclass
class Replica:
    proc: RouterProc

    @property
    def url(self) -> str:
        return self.proc.url

    def ready(self) -> dict[str, Any]:
        return get_json(f"{self.url}/ready")

    def policy(self) -> dict[str, Any]:
        return get_json(f"{self.url}/policy")

    def version(self) -> int:
        version: int = self.policy()["policy"]["version"]
        return version

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.ready()["state"]
        return state

    def cluster_inflight(self) -> dict[str, int]:
        counts: dict[str, int] = self.ready()["cluster_inflight"]
        return counts

    def local_inflight(self) -> dict[str, int]:
        return {b["name"]: b["inflight"] for b in self.ready()["backends"]}

    def write(self, method: str, body: Mapping[str, Any]) -> httpx.Response:
        return loopback.request(method, f"{self.url}/policy", json=dict(body), timeout=10.0,
                             headers={"authorization": f"Bearer {ADMIN_TOKEN}"})

    def metrics(self) -> str:
        return loopback.get(f"{self.url}/metrics", timeout=5.0).text


@dataclass
class Cluster:
    replicas: list[Replica]
    redis: RedisServer
    group: SimGroup
    prefix: str

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[i]

    def wait_all(self, predicate: Callable[[Replica], bool], timeout: float, what: str) -> None:
        wait_until(lambda: all(predicate(r) for r in self.replicas), timeout, what)

    def total_local(self) -> dict[str, int]:
        totals = dict.fromkeys(BACKENDS, 0)
        for r in self.replicas:
            for name, count in r.local_inflight().items():
                totals[name] += count
        return totals


ClusterFactory = Callable[..., Cluster]


@pytest.fixture
def replicas(
    redis_server: RedisServer, sim_group: Callable[..., SimGroup], router: RouterFactory
) -> ClusterFactory:
    def start(policy: Mapping[str, Any] | None = None, ttl_s: float = 1.0, count: int = 3,
              time_scale: float = 1.0, state: Mapping[str, Any] | None = None) -> Cluster:
        group = sim_group(time_scale=time_scale, group="gpu0")
        backends = [{"name": f"gpu0-{pool}", "url": group.url(pool), "pool": pool,
                     "group": "gpu0"} for pool in ("eagle", "baseline")]
        prefix = "clustertest"
        env = {
            "SPECROUTER_REDIS_URL": redis_server.url(),
            "SPECROUTER_STATE": json.dumps({"key_prefix": prefix, "ttl_s": ttl_s,
                                            "heartbeat_s": ttl_s / 4, **(state or {})}),
            "SPECROUTER_POLICY": json.dumps(dict(policy or {})),
            "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
            "SPECROUTER_HEALTH": json.dumps(FAST_HEALTH),
            "SPECROUTER_ADMISSION": json.dumps({"arrival_window_ms": 0}),
        }
        procs = [router(backends, env=env) for _ in range(count)]
        cluster = Cluster([Replica(p) for p in procs], redis_server, group, prefix)
        cluster.wait_all(lambda r: r.state()["connected"]
                         and r.state()["replicas_seen"] == count
                         and all(b["check_path"] for b in r.ready()["backends"]),
                         30.0, "every replica connected to redis, seeing all, backends checked")
        return cluster

    return start


@dataclass
class Held:
    """Streaming chat requests held open (httpx); closing one is a client disconnect."""

    client: httpx.AsyncClient = field(default_factory=lambda: loopback.async_client(timeout=60.0))
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    routed: list[tuple[str, str]] = field(default_factory=list)  # (replica url, pool)

    async def open(self, base_url: str, max_tokens: int = LONG,
                   pool: str | None = None) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        headers = {"x-specrouter-pool": pool} if pool else {}
        response = await self.stack.enter_async_context(
            self.client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                               headers=headers))
        assert response.status_code == 200, await response.aread()
        routed_pool = response.headers["x-specrouter-pool"]
        self.routed.append((base_url, routed_pool))
        return routed_pool

    async def aclose(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.stack.aclose()
        await self.client.aclose()


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking wait off the event loop that holds the streams."""
    return await asyncio.to_thread(fn, *args)
