"""Shared pieces of the drills: a simulated group behind a router tuned for fast faults,
clients that classify every outcome, and the invariants each drill ends with.

Every drill checks the same three things: no request that could have been served was lost
(it got a complete answer), every failed request got a clear error (an OpenAI-format error
body or an SSE error event, never a hang or a bare cut), and the router's in-flight counts,
read over HTTP from /ready, are back to zero afterwards.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.router import RouterFactory, RouterProc
from tests.fixtures.sim import SimGroup

MODEL = "drill-model"
ADMIN_TOKEN = "drill-admin-token-3c9a"
FAST_HEALTH = {"interval_s": 0.1, "ready_timeout_s": 0.5, "health_timeout_s": 0.5}
FAST_BREAKER = {"failure_threshold": 3, "window_s": 10.0, "cooldown_s": 0.5,
                "success_threshold": 2, "check_failures_to_down": 2}
FAST_TIMEOUTS = {"connect": 1.0, "first_byte": 2.0, "total": 10.0}


def chat_body(max_tokens: int = 8, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "stream": stream, "ignore_eos": True, **extra}


@dataclass
class Outcome:
    """What one client saw: `ok` (a complete answer) or a clear error, never anything else."""

    status: int
    ok: bool
    error: str | None = None  # the error message the client was given
    pool: str | None = None


def _event_error(data: str) -> str | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    error = event.get("error") if isinstance(event, dict) else None
    return str(error.get("message")) if isinstance(error, dict) else None


async def call(client: httpx.AsyncClient, url: str, body: Mapping[str, Any],
               headers: Mapping[str, str] | None = None, timeout: float = 20.0) -> Outcome:
    """One request; raises AssertionError on an unclear failure (hang, bare cut, non-JSON)."""
    async with asyncio.timeout(timeout):
        if not body.get("stream"):
            response = await client.post(url, json=dict(body), headers=dict(headers or {}))
            return _buffered_outcome(response)
        async with client.stream("POST", url, json=dict(body),
                                 headers=dict(headers or {})) as response:
            if response.status_code != 200:
                await response.aread()
                return _buffered_outcome(response)
            done, error = False, None
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                    elif error is None:
                        error = _event_error(data)
            except httpx.HTTPError as exc:
                raise AssertionError(f"stream cut without an error event: {exc!r}") from exc
            assert done, "stream ended without data: [DONE]"
            pool = response.headers.get("x-specrouter-pool")
            return Outcome(200, error is None, error, pool)


def _buffered_outcome(response: httpx.Response) -> Outcome:
    assert response.headers.get("content-type", "").startswith("application/json"), \
        f"HTTP {response.status_code} without a JSON body: {response.text[:200]!r}"
    body = response.json()
    pool = response.headers.get("x-specrouter-pool")
    if response.status_code == 200:
        return Outcome(200, True, None, pool)
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else body.get("message")
    assert isinstance(message, str) and message, f"error without a message: {body!r}"
    return Outcome(response.status_code, False, message, pool)


async def run_load(url: str, count: int, concurrency: int, body: Mapping[str, Any],
                   headers: Mapping[str, str] | None = None) -> list[Outcome]:
    """`count` requests, `concurrency` at a time; every outcome, in completion order."""
    outcomes: list[Outcome] = []
    limit = asyncio.Semaphore(concurrency)
    async with loopback.async_client(timeout=30.0) as client:
        async def one() -> None:
            async with limit:
                outcomes.append(await call(client, f"{url}/v1/chat/completions", body, headers))
        await asyncio.gather(*(one() for _ in range(count)))
    return outcomes


def assert_idle(router: RouterProc, timeout: float = 15.0) -> None:
    """In-flight counts back to zero, read over HTTP (/ready and the /policy live view)."""
    router.wait_idle(timeout)
    view = loopback.get(f"{router.url}/policy", timeout=5.0).json()
    live = {b["name"]: b["inflight"] for b in view["backends"]}
    assert not any(live.values()), f"/policy live view still counts requests: {live}"
    ready = router.ready()
    assert ready["inflight_total"] == 0, ready


def assert_alive(router: RouterProc) -> None:
    proc = router.process.proc
    assert proc is not None and proc.poll() is None, router.process.output()[-3000:]


@dataclass
class Drill:
    """Simulated GPU groups behind one router with fast health checks and short timeouts."""

    router: RouterProc
    groups: dict[str, SimGroup]
    token: str = ADMIN_TOKEN

    @property
    def url(self) -> str:
        return self.router.url

    def sim(self, group: str = "gpu0") -> SimGroup:
        return self.groups[group]

    def backend(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(b for b in self.router.ready()["backends"]
                                     if b["name"] == name)
        return found

    def wait_backend(self, name: str, predicate: Callable[[dict[str, Any]], bool],
                     what: str, timeout: float = 15.0) -> None:
        wait_until(lambda: predicate(self.backend(name)), timeout, f"{name}: {what}")


DrillFactory = Callable[..., Drill]


@pytest.fixture
def drill(sim_group: Callable[..., SimGroup], router: RouterFactory) -> DrillFactory:
    def start(groups: Sequence[str] = ("gpu0",), time_scale: float = 0.05,
              env: Mapping[str, str] | None = None, policy: Mapping[str, Any] | None = None,
              timeouts: Mapping[str, float] | None = None) -> Drill:
        sims = {g: sim_group(time_scale=time_scale, group=g) for g in groups}
        backends = [{"name": f"{g}-{pool}", "url": sim.url(pool), "pool": pool, "group": g}
                    for g, sim in sims.items() for pool in ("eagle", "baseline")]
        router_env = {
            "SPECROUTER_HEALTH": json.dumps(FAST_HEALTH),
            "SPECROUTER_BREAKER": json.dumps(FAST_BREAKER),
            "SPECROUTER_TIMEOUTS": json.dumps(dict(timeouts or FAST_TIMEOUTS)),
            "SPECROUTER_POLICY": json.dumps(dict(policy or {})),
            "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
            **(env or {}),
        }
        proc = router(backends, env=router_env)
        wait_until(lambda: all(b["check_path"] for b in proc.ready()["backends"]), 20.0,
                   "a health check of every backend")
        return Drill(proc, sims)

    return start
