"""A wedged scheduler on the simulator speaking SGLang 0.5.23, over real loopback HTTP:
its /ready still answers 200 and /v1/loads still answers its last snapshot, yet the
health checker marks it down with a clear reason (no answer to /health_generate), the
load view ages its frozen snapshot out, and both come back when it progresses again."""

from __future__ import annotations

import asyncio
import time

from loadtest import loopback
from specrouter.backends import Backend
from specrouter.config import HealthSettings
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import LoadView
from specrouter.observe.telemetry import TelemetryPoller
from tests.fixtures.procs import ManagedProcess, eventually, free_port, specrouter_argv
from tests.observe.test_telemetry_poller import hold_requests

SETTINGS = HealthSettings(interval_s=0.2, generation_check_s=0.5, generation_timeout_s=2.0)


async def scenario(eagle: str, base: str) -> None:
    backend = Backend("e", eagle, "eagle", "g")
    health = HealthChecker([backend], SETTINGS, BreakerConfig())
    lv = LoadView(poll_interval=0.1)
    lv.add_backend("e", "g", "eagle")
    poller = TelemetryPoller([backend], lv.publish, lv.publish_accept, lv.poll_started)
    await health.start()
    try:
        async with poller, loopback.async_client(timeout=10.0) as client:
            await eventually(lambda: health.describe("e")["check_path"] == "/ready", 30.0,
                             "a first check")
            tasks = await hold_requests(eagle, 2)
            await eventually(lambda: lv.backend_view("e", time.monotonic()).load("engine") >= 2,
                             30.0, "the requests in the engine")
            # Sent through the sibling engine: the wedged one's HTTP side still answers.
            r = await client.post(base + "/sim/control", json={"engine": "eagle", "wedged": True})
            assert r.status_code == 200, r.text
            await eventually(lambda: not health.healthy("e"), 30.0, "the wedge to be found")
            assert "wedged" in str(health.describe("e")["last_error"])
            assert (await client.get(eagle + "/ready")).status_code == 200
            await eventually(lambda: lv.backend_view("e", time.monotonic()).stale, 30.0,
                             "the frozen snapshot to age out")
            assert poller.source_of("e") == "v1_loads"  # it still answers

            r = await client.post(base + "/sim/control", json={"engine": "eagle", "wedged": False})
            assert r.status_code == 200, r.text
            await eventually(lambda: health.healthy("e"), 30.0, "the backend back")
            await eventually(lambda: not lv.backend_view("e", time.monotonic()).stale, 30.0,
                             "fresh snapshots again")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await health.stop()


def test_a_wedged_scheduler_is_found_and_recovers(process_factory: list[ManagedProcess]) -> None:
    pe, pb = free_port(), free_port()
    sim = ManagedProcess(specrouter_argv(
        "sim", "--eagle-port", str(pe), "--baseline-port", str(pb), "--time-scale", "1.0",
        "--sglang-version", "0.5.23", "--seed", "3"))
    process_factory.append(sim.start())
    eagle, base = f"http://127.0.0.1:{pe}", f"http://127.0.0.1:{pb}"
    sim.wait_http(eagle + "/metrics", 60).wait_http(base + "/metrics", 60)
    asyncio.run(scenario(eagle, base))
