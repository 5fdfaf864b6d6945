"""Two simulated GPU groups behind one load-aware router (real processes on loopback).

`cluster(policy=..., env=..., time_scale=...)` starts groups gpu0 and gpu1 (an EAGLE-3 and a
baseline engine each, from `specrouter sim`) and a `specrouter serve` in front of them. The
router's health checks and breaker are tuned fast (tenths of a second) so fault tests
finish quickly; everything else is the product's default.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.router import RouterFactory, RouterProc
from tests.fixtures.sim import SimGroup

ADMIN_TOKEN = "test-admin-token-5b1f"
GROUPS = ("gpu0", "gpu1")
# /health is a generation on SGLang 0.5.10 (no /ready), acknowledged after the current
# batch: 0.5 s was too short for it on a busy 2-core host (backends flapped unhealthy)
FAST_HEALTH = {"interval_s": 0.1, "ready_timeout_s": 0.5, "health_timeout_s": 2.0}
FAST_BREAKER = {"failure_threshold": 3, "window_s": 10.0, "cooldown_s": 0.5,
                "success_threshold": 2, "check_failures_to_down": 2}


def backend_name(group: str, pool: str) -> str:
    return f"{group}-{pool}"


@dataclass
class Cluster:
    router: RouterProc
    groups: dict[str, SimGroup]
    token: str | None

    @property
    def url(self) -> str:
        return self.router.url

    def sim(self, group: str) -> SimGroup:
        return self.groups[group]

    def ready(self) -> dict[str, Any]:
        return self.router.ready()

    def backend(self, name: str) -> dict[str, Any]:
        backend: dict[str, Any] = next(b for b in self.ready()["backends"] if b["name"] == name)
        return backend

    def policy(self) -> dict[str, Any]:
        view: dict[str, Any] = loopback.get(f"{self.url}/policy", timeout=5.0).json()
        return view

    def write_policy(self, method: str, body: Any, token: str | None = None) -> httpx.Response:
        token = self.token if token is None else token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return loopback.request(method, f"{self.url}/policy", json=body, headers=headers,
                             timeout=5.0)

    def patch(self, **fields: Any) -> dict[str, Any]:
        response = self.write_policy("PATCH", fields)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def wait_backend(self, name: str, what: str, predicate: Callable[[dict[str, Any]], bool],
                     timeout: float = 15.0) -> dict[str, Any]:
        wait_until(lambda: predicate(self.backend(name)), timeout, f"{name}: {what}")
        return self.backend(name)


ClusterFactory = Callable[..., Cluster]


@pytest.fixture
def cluster(sim_group: Callable[..., SimGroup], router: RouterFactory) -> ClusterFactory:
    def start(
        policy: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        time_scale: float = 1.0,
        token: str | None = ADMIN_TOKEN,
        profile: str = "seed-coding",
        extra_args: tuple[str, ...] = (),
    ) -> Cluster:
        groups = {g: sim_group(profile=profile, time_scale=time_scale, group=g) for g in GROUPS}
        backends = [
            {"name": backend_name(g, pool), "url": sim.url(pool), "pool": pool, "group": g}
            for g, sim in groups.items() for pool in ("eagle", "baseline")
        ]
        router_env = {
            "SPECROUTER_HEALTH": json.dumps(FAST_HEALTH),
            "SPECROUTER_BREAKER": json.dumps(FAST_BREAKER),
            "SPECROUTER_POLICY": json.dumps(dict(policy or {})),
            **({"SPECROUTER_ADMIN_TOKEN": token} if token else {}),
            **(env or {}),
        }
        proc = router(backends, env=router_env, extra_args=extra_args)
        # Ready once every backend answered a health check and a telemetry poll.
        wait_until(lambda: all(b["check_path"] and b["telemetry"]["source"]
                               for b in proc.ready()["backends"]), 20.0,
                   "health checks and telemetry of every backend")
        return Cluster(proc, groups, token)

    return start
