"""Graceful shutdown of a real `specrouter serve` process: SIGTERM turns /ready 503 at
once, refuses new requests with an OpenAI-format 503, lets the stream in flight finish,
then exits; a stream longer than the drain timeout is cut when it runs out."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from loadtest import loopback
from tests.drills.conftest import MODEL, DrillFactory, Outcome, call, chat_body
from tests.fixtures.departures import leave, random_departures
from tests.fixtures.procs import eventually, wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory
from tests.fixtures.sim import SimGroup


def _stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, dict[str, object]]:
    """A streaming request read to its end in a thread; `seen` fills as it goes."""
    seen: dict[str, object] = {"chunks": 0, "done": False, "error": None}
    started = threading.Event()

    def run() -> None:
        try:
            with loopback.stream("POST", f"{url}/v1/chat/completions",
                              json=chat_body(max_tokens), timeout=30.0) as response:
                seen["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        seen["chunks"] = int(seen["chunks"]) + 1  # type: ignore[call-overload]
                        started.set()
                        if line == "data: [DONE]":
                            seen["done"] = True
        except httpx.HTTPError as exc:
            seen["error"] = repr(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(20), "stream never started"
    return thread, seen


def test_sigterm_drains_ready_503_new_requests_refused_stream_finishes(
    drill: DrillFactory,
) -> None:
    d = drill(time_scale=1.0, env={"SPECROUTER_SHUTDOWN__DRAIN_TIMEOUT_S": "30"})
    thread, seen = _stream_in_thread(d.url, max_tokens=150)  # ~3 s at real pace
    assert d.router.ready()["inflight_total"] == 1
    d.router.process.signal(signal.SIGTERM)

    ready = loopback.get(f"{d.url}/ready", timeout=5.0)
    wait_until(lambda: loopback.get(f"{d.url}/ready", timeout=5.0).status_code == 503, 5.0,
               "/ready to turn 503")
    ready = loopback.get(f"{d.url}/ready", timeout=5.0)
    assert ready.json()["draining"] is True and ready.json()["ready"] is False
    refused = loopback.post(f"{d.url}/v1/chat/completions", json=chat_body(4, stream=False),
                         timeout=5.0)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["connection"] == "close"
    assert loopback.get(f"{d.url}/health", timeout=5.0).status_code == 200  # still alive
    assert d.router.process.proc is not None and d.router.process.proc.poll() is None

    thread.join(30)
    assert seen["status"] == 200 and seen["done"] is True and seen["error"] is None, seen
    proc = d.router.process.proc
    proc.wait(15)
    log = d.router.process.output()
    assert "draining: /ready is 503" in log and "drained: no request in progress" in log, log


def test_a_second_ctrl_c_skips_the_drain_but_not_the_shutdown(drill: DrillFactory) -> None:
    """Ctrl-C drains; a second Ctrl-C during the drain ends it, and the router still runs
    its lifespan shutdown (a forced exit would skip it) and exits quietly (uvicorn still
    logs the stream it cancels at its graceful timeout)."""
    d = drill(time_scale=1.0, env={"SPECROUTER_SHUTDOWN__DRAIN_TIMEOUT_S": "30"})
    thread, seen = _stream_in_thread(d.url, max_tokens=1500)  # far longer than the test
    d.router.process.signal(signal.SIGINT)
    wait_until(lambda: "draining: /ready is 503" in d.router.process.output(), 5.0,
               "the drain to start")
    d.router.process.signal(signal.SIGINT)
    proc = d.router.process.proc
    assert proc is not None
    proc.wait(15)  # the drain's 30 s not waited
    thread.join(15)
    assert seen["done"] is not True, seen  # the stream was cut, not finished
    output = d.router.process.output()
    assert "Application shutdown complete" in output, output[-4000:]
    assert "KeyboardInterrupt" not in output, output[-4000:]
    assert proc.returncode == 0


def test_drain_timeout_cuts_a_longer_stream_then_exits(drill: DrillFactory) -> None:
    d = drill(time_scale=1.0, env={"SPECROUTER_SHUTDOWN__DRAIN_TIMEOUT_S": "1"})
    thread, seen = _stream_in_thread(d.url, max_tokens=3000)  # a minute at real pace
    d.router.process.signal(signal.SIGTERM)
    began = time.monotonic()
    proc = d.router.process.proc
    assert proc is not None
    proc.wait(15)
    took = time.monotonic() - began
    thread.join(10)
    assert 0.9 <= took < 8.0, took  # the drain timeout, uvicorn's 1 s close, start-up slack
    assert seen["done"] is False  # cut, not finished
    assert "drain timeout: 1 request(s) still in progress are cut" in d.router.process.output()
    # The engine saw the cut as a client disconnect: it freed the batch slot.
    sim = d.sim()
    wait_until(lambda: sim.state("eagle")["running"] == 0 and sim.state("eagle")["aborted"] == 1,
               10.0, "the engine to abort the cut stream")


def test_idle_router_exits_promptly_on_sigterm(drill: DrillFactory) -> None:
    d = drill(env={"SPECROUTER_SHUTDOWN__DRAIN_TIMEOUT_S": "30"})
    assert loopback.post(f"{d.url}/v1/chat/completions", json=chat_body(4, stream=False),
                      timeout=10.0).json()["model"] == MODEL
    began = time.monotonic()
    d.router.process.signal(signal.SIGTERM)
    assert d.router.process.proc is not None
    d.router.process.proc.wait(10)
    assert time.monotonic() - began < 5.0


def test_workers_drain_too(router: RouterFactory, sim_group: Callable[..., SimGroup],
                           redis_server: RedisServer) -> None:
    """`--workers 2`: SIGTERM to the supervisor reaches each worker, which drains the same
    way (the supervisor's forwarded SIGTERM does not cut the drain short)."""
    sim = sim_group(time_scale=1.0)
    backends = [{"name": f"gpu0-{p}", "url": sim.url(p), "pool": p, "group": "gpu0"}
                for p in ("eagle", "baseline")]
    r = router(backends, extra_args=("--workers", "2"),
               env={"SPECROUTER_REDIS_URL": redis_server.url(),
                    "SPECROUTER_SHUTDOWN__DRAIN_TIMEOUT_S": "30"})
    # /ready answered from one worker; a SIGTERM while the other is still starting ends
    # that one before its drain handler exists (the test's race, not the product's).
    wait_until(lambda: r.process.output().count("Application startup complete.") == 2, 20.0,
               "both workers to start")
    thread, seen = _stream_in_thread(r.url, max_tokens=300)
    proc = r.process.proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGTERM)  # the supervisor only, as an orchestrator does
    # The idle worker drains at once and exits; a connection it accepted as it closed is
    # dropped unanswered (uvicorn's shutdown of an idle connection), so the probes wait
    # for it to be gone and then meet the draining worker that holds the stream.
    wait_until(lambda: r.process.output().count("Finished server process") >= 1, 20.0,
               "the idle worker to exit")
    assert loopback.get(f"{r.url}/ready", timeout=5.0).status_code == 503
    refused = loopback.post(f"{r.url}/v1/chat/completions", json=chat_body(4, stream=False),
                         timeout=5.0)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    thread.join(30)
    assert seen["status"] == 200 and seen["done"] is True and seen["error"] is None, seen
    proc.wait(20)
    assert r.process.output().count("drained: no request in progress") == 2


@pytest.mark.parametrize("seed", [3, 17])
def test_sigterm_amid_leaving_clients_drains_and_exits_clean(drill: DrillFactory,
                                                              seed: int) -> None:
    """SIGTERM while clients leave at every point of their requests
    (tests/fixtures/departures.py) and others stream: every client that stays gets a
    whole answer or the OpenAI 503 of a draining router, the process drains and exits
    within its drain timeout, logs no traceback, and the engines end with nothing running."""
    d = drill(env={"SPECROUTER_SHUTDOWN__DRAIN_TIMEOUT_S": "10"})
    port = int(d.url.rsplit(":", 1)[1])
    rng = random.Random(seed)
    plans = random_departures(rng, 24)

    async def scenario() -> list[Outcome]:
        async with asyncio.timeout(60.0), loopback.async_client(timeout=30.0) as client:
            url = f"{d.url}/v1/chat/completions"
            stayers = [asyncio.ensure_future(call(client, url, chat_body(max_tokens=60)))
                       for _ in range(6)]
            leavers = asyncio.gather(*(leave(port, plan) for plan in plans),
                                     return_exceptions=True)  # refused once draining
            await eventually(lambda: d.router.ready()["inflight_total"] > 0, 10.0,
                             "requests in flight")
            d.router.process.signal(signal.SIGTERM)
            await leavers
            return list(await asyncio.gather(*stayers))

    outcomes = asyncio.run(scenario())
    for o in outcomes:
        assert o.ok or (o.status == 503 and o.error), o
    proc = d.router.process.proc
    assert proc is not None
    proc.wait(20)  # uvicorn re-raises the SIGTERM it handled once it has shut down
    output = d.router.process.output()
    assert "drained: no request in progress" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    sim = d.sim()
    wait_until(lambda: all(sim.state(p)["running"] == 0 and sim.state(p)["waiting"] == 0
                           for p in ("eagle", "baseline")), 15.0, "the engines to be idle")
