"""The telemetry poller against a simulated SGLang group over real loopback HTTP."""

from __future__ import annotations

import asyncio
import time

from loadtest import loopback
from specrouter.backends import Backend
from specrouter.observe.loadview import LoadView
from specrouter.observe.telemetry import TelemetryPoller
from tests.fixtures.procs import ManagedProcess, eventually, free_port, specrouter_argv

KEY = "sim-key-123"


async def hold_requests(url: str, n: int) -> list[asyncio.Task[None]]:
    """Start `n` long streaming chats and keep them open until cancelled."""

    async def one() -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 100000, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        async with loopback.async_client(timeout=60.0, headers=headers) as client, \
                client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass

    return [asyncio.create_task(one()) for _ in range(n)]


async def scenario(sim: ManagedProcess, eagle: str, base: str) -> None:
    lv = LoadView(poll_interval=0.1)
    lv.add_backend("e", "gpu0", "eagle")
    lv.add_backend("b", "gpu0", "baseline")
    lv.add_backend("e-nokey", "gpu1", "eagle")
    poller = TelemetryPoller(
        [Backend("e", eagle, "eagle", "gpu0", KEY), Backend("b", base, "baseline", "gpu0", KEY),
         Backend("e-nokey", eagle, "eagle", "gpu1")],
        lv.publish, lv.publish_accept, poll_started=lv.poll_started, interval=0.1)
    async with poller:
        await eventually(lambda: all(b.sample is not None for b in lv.backends.values()),
                         30.0, "a first sample from every target")
        # With the key /v1/loads answers; without it only the auth-exempt /metrics does.
        assert poller.source_of("e") == "v1_loads" and poller.source_of("b") == "v1_loads"
        assert poller.source_of("e-nokey") == "metrics"
        assert "sim-key" not in repr(poller.backends)

        tasks = await hold_requests(eagle, 5)
        try:
            await eventually(
                lambda: lv.backend_view("e", time.monotonic()).load("engine") >= 5,
                30.0, "the engine to report 5 requests")
            await eventually(
                lambda: lv.group_view("gpu0", time.monotonic()).eagle_accept()[0] is not None,
                30.0, "a live accept length")
            accept = lv.group_view("gpu0", time.monotonic()).eagle_accept()[0]
            assert accept is not None and 1.0 < accept < 10.0
            # The load comes from /v1/loads, the windowed accept length from /metrics.
            assert poller.accept_status("e") == "metrics"
            # The workload shifts: the windowed reading follows within seconds, while
            # SGLang's lifetime mean in /v1/loads stays near where it was.
            await eventually(lambda: lv.backends["e"].accept_lifetime is not None, 30.0,
                             "a first fold of the lifetime mean")
            async with loopback.async_client(timeout=10.0) as client:
                shift = await client.post(eagle + "/sim/control",
                                          json={"accept_length": 1.2},
                                          headers={"Authorization": f"Bearer {KEY}"})
                assert shift.status_code == 200, shift.text
            follow_s = await eventually(
                lambda: (lv.backends["e"].accept_length or 9.0) < 1.4, 30.0, "the shift")
            lifetime = lv.backends["e"].accept_lifetime
            assert follow_s < 5.0 and lifetime is not None and lifetime > 1.4, (follow_s, lifetime)
            assert lv.backend_view("b", time.monotonic()).load("engine") == 0.0
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await eventually(lambda: lv.backend_view("e", time.monotonic()).load("engine") == 0,
                         30.0, "aborted requests to leave the engine")

        # 0.5.23 without its snapshot reader answers "loads": []: no data, so the poller
        # reads the load from /metrics instead of taking it as an idle engine.
        async with loopback.async_client(timeout=10.0) as client:
            detach = await client.post(eagle + "/sim/control",
                                       json={"loads_reader_detached": True},
                                       headers={"Authorization": f"Bearer {KEY}"})
            assert detach.status_code == 200, detach.text
            empty = await client.get(eagle + "/v1/loads",
                                     headers={"Authorization": f"Bearer {KEY}"})
            assert empty.json()["loads"] == []
        await eventually(lambda: poller.source_of("e") == "metrics", 30.0, "the fallback")

        # The servers go away: no new samples, the view goes stale and falls back.
        await asyncio.to_thread(sim.stop)
        await eventually(lambda: lv.backend_view("e", time.monotonic()).stale, 30.0, "staleness")
        await eventually(lambda: poller.source_of("e") is None, 30.0, "a failed poll")
        assert lv.stale_reads()["e"] > 0


def test_poller_reads_simulated_group(process_factory: list[ManagedProcess]) -> None:
    pe, pb = free_port(), free_port()
    sim = ManagedProcess(specrouter_argv(
        "sim", "--eagle-port", str(pe), "--baseline-port", str(pb), "--api-key", KEY,
        "--time-scale", "0.2", "--seed", "3"))
    process_factory.append(sim.start())
    eagle, base = f"http://127.0.0.1:{pe}", f"http://127.0.0.1:{pb}"
    sim.wait_http(eagle + "/metrics", 60).wait_http(base + "/metrics", 60)
    asyncio.run(scenario(sim, eagle, base))
