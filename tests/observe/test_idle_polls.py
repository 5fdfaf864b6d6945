"""An idle server is polled at the idle interval; a request routed to it, or work that
reached it past the router, brings the busy interval back. Over real loopback HTTP, against
a scripted server that answers /v1/loads as SGLang 0.5.23 does."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from specrouter.backends import Backend
from specrouter.config import HealthSettings, TelemetrySettings
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import LoadView
from specrouter.observe.telemetry import TelemetryPoller
from specrouter.routing.monitor import BackendMonitor
from tests.fixtures.procs import eventually

#: Long enough that no test waits it out: a poll that comes sooner came from `busy`.
IDLE_S = 60.0
INTERVAL_S = 0.02


@dataclass
class LoadsServer:
    """Answers every request with a /v1/loads body of `running` requests; counts polls."""

    running: int = 0
    polls: int = 0
    polled: asyncio.Event = field(default_factory=asyncio.Event)

    def answer(self) -> bytes:
        now = time.time()
        body = json.dumps({
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + "+00:00",
            "version": "0.5.23", "loads": [{
                "dp_rank": 0, "timestamp": now, "num_running_reqs": self.running,
                "num_waiting_reqs": 0, "max_running_requests": 48}]}).encode()
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.polls += 1
                self.polled.set()
                writer.write(self.answer())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def next_poll(self, timeout: float) -> None:
        self.polled.clear()
        await asyncio.wait_for(self.polled.wait(), timeout)


@asynccontextmanager
async def loads_server() -> AsyncIterator[tuple[LoadsServer, Backend]]:
    state = LoadsServer()
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield state, Backend("e", f"http://127.0.0.1:{port}", "eagle", "gpu0")


def test_an_idle_server_waits_the_idle_interval_until_a_request_is_routed_to_it(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        busy = {"e": False}
        lv = LoadView(poll_interval=INTERVAL_S, idle_poll_interval=IDLE_S)
        lv.add_backend("e", "gpu0", "eagle")
        async with loads_server() as (server, backend):
            poller = TelemetryPoller([backend], lv.publish, None, lv.poll_started,
                                     interval=INTERVAL_S, idle_interval=IDLE_S,
                                     busy=busy.__getitem__)
            async with poller:
                await eventually(lambda: lv.backends["e"].sample is not None, 10.0,
                                 "a first sample")
                assert poller.delay("e") == IDLE_S
                assert not lv.backend_view("e", time.monotonic()).stale
                server.running = 3
                busy["e"] = True  # the router sends it a request
                assert poller.delay("e") == INTERVAL_S
                poller.wake("e")
                await server.next_poll(10.0)
                busy["e"] = False  # ...which ends; the engine still runs work of others
                await eventually(lambda: lv.backend_view("e", time.monotonic()).engine == 3,
                                 10.0, "the busy engine's load")
                # Busy with work the router did not send: polled at the busy interval.
                for _ in range(3):
                    await server.next_poll(10.0)
                assert poller.delay("e") == INTERVAL_S
                server.running = 0
                await eventually(lambda: poller.delay("e") == IDLE_S, 10.0, "idle again")

    with caplog.at_level(logging.INFO, "specrouter.observe.telemetry"):
        asyncio.run(scenario())
    # the idle interval is no search for a lost load endpoint: nothing to say in the log
    assert not [r for r in caplog.records if "again" in r.getMessage()], caplog.text


def test_a_request_routed_to_an_idle_group_brings_its_servers_next_polls() -> None:
    async def scenario() -> None:
        async with loads_server() as (server, backend):
            baseline = Backend("b", backend.url, "baseline", "gpu0")
            health = HealthChecker([backend, baseline], HealthSettings(enabled=False),
                                   BreakerConfig(failure_threshold=2, cooldown_s=5.0,
                                                 success_threshold=1))
            monitor = BackendMonitor([backend, baseline], health, TelemetrySettings(
                interval_s=INTERVAL_S, idle_interval_s=IDLE_S))
            poller = monitor.poller
            assert poller is not None and monitor.view.idle_poll_interval == IDLE_S
            await monitor.start()
            try:
                await eventually(lambda: poller.delay("e") == IDLE_S == poller.delay("b"),
                                 10.0, "both servers read idle")
                monitor.acquire(1, "e")
                # the group's servers share a GPU: both count as busy, both are polled
                assert monitor.busy("e") and monitor.busy("b")
                assert poller.delay("e") == INTERVAL_S == poller.delay("b")
                await server.next_poll(10.0)
                await server.next_poll(10.0)
                monitor.release(1, "e")
                assert not monitor.busy("e") and not monitor.busy("b")
            finally:
                await monitor.stop()

    asyncio.run(scenario())


def test_an_idle_interval_below_the_poll_interval_counts_as_the_poll_interval() -> None:
    settings = TelemetrySettings(interval_s=2.0)
    assert settings.idle_poll_s == 2.0
    assert TelemetrySettings().idle_poll_s == 1.0


class _OtherReplicas:
    """The shared state as `ClusterCounts` reads it: the store's cluster-wide counts."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.store = self

    def cluster_inflight(self) -> dict[str, int]:
        return self.counts


def test_another_replicas_request_to_the_group_counts_as_busy() -> None:
    backends = [Backend("e", "http://127.0.0.1:9", "eagle", "gpu0"),
                Backend("b", "http://127.0.0.1:9", "baseline", "gpu0"),
                Backend("e1", "http://127.0.0.1:9", "eagle", "gpu1")]
    health = HealthChecker(backends, HealthSettings(enabled=False),
                           BreakerConfig(failure_threshold=2, cooldown_s=5.0,
                                         success_threshold=1))
    others = _OtherReplicas({})
    monitor = BackendMonitor(backends, health, TelemetrySettings(),
                             state=others)  # type: ignore[arg-type]
    assert not any(monitor.busy(b.name) for b in backends)
    others.counts["b"] = 1  # another replica routed a request to gpu0's baseline
    assert monitor.busy("e") and monitor.busy("b") and not monitor.busy("e1")
