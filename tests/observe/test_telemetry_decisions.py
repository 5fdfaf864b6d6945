"""The poller's decisions on SGLang's answers: where the windowed accept length comes
from, what it does without one, and a failure on the router's own side. Answers come
from an httpx transport that replies in SGLang's shapes; no sockets are needed to decide."""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable

import httpx
import pytest

from loadtest import loopback
from specrouter.backends import Backend
from specrouter.observe.loadview import LoadView
from specrouter.observe.telemetry import SEARCH_INTERVAL_S, SEARCH_MISSES, TelemetryPoller
from tests.observe.test_telemetry_parsers import sglang_metrics_text, v1_loads_rank

EAGLE = Backend("e", "http://eagle", "eagle", "g")
Handler = Callable[[httpx.Request], httpx.Response]


def loads(running: int, lifetime: float) -> httpx.Response:
    return httpx.Response(200, json={"timestamp": "2026-12-02T13:00:00+00:00",
                                     "version": "0.5.10", "dp_rank_count": 1,
                                     "loads": [v1_loads_rank(0, running, 0, lifetime)]})


def poller_for(handler: Handler, lv: LoadView, clock: list[float]) -> TelemetryPoller:
    return TelemetryPoller([EAGLE], lv.publish, lv.publish_accept, lv.poll_started,
                           accept_every=2, clock=lambda: clock[0],
                           client=loopback.async_client(transport=httpx.MockTransport(handler)))


def view() -> LoadView:
    lv = LoadView(poll_interval=0.1)
    lv.add_backend("e", "g", "eagle")
    return lv


def test_the_windowed_accept_comes_from_metrics_never_from_the_lifetime_mean() -> None:
    gauge = [2.9]

    def sglang(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/loads":
            return loads(8, 3.0)  # the lifetime mean stays at 3.0 after the shift
        return httpx.Response(200, text=sglang_metrics_text([8], [0], gauge[0]))

    lv, clock = view(), [10.0]
    poller = poller_for(sglang, lv, clock)

    async def run() -> None:
        for _ in range(4):
            clock[0] += 0.1
            await poller.poll_once(EAGLE)
            gauge[0] = 1.6  # the workload shifts after the first /metrics read
    asyncio.run(run())
    b = lv.backends["e"]
    assert poller.source_of("e") == "v1_loads" and poller.accept_status("e") == "metrics"
    assert b.accept_length == pytest.approx(1.6) and b.accept_lifetime == pytest.approx(3.0)
    assert b.accept_window == (1.6,) and b.accept_batch == 8


def test_without_metrics_the_accept_is_unknown_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_metrics(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/loads":
            return loads(3, 2.5)
        return httpx.Response(404, json={"detail": "Not Found"})

    lv, clock = view(), [10.0]
    poller = poller_for(no_metrics, lv, clock)

    async def run() -> None:
        for _ in range(6):
            clock[0] += 0.1
            await poller.poll_once(EAGLE)
    with caplog.at_level(logging.WARNING, "specrouter.observe.telemetry"):
        asyncio.run(run())
    b = lv.backends["e"]
    assert b.sample is not None and b.sample.total == 3  # the load still flows
    assert b.accept_length is None and b.accept_lifetime == pytest.approx(2.5)
    assert poller.accept_status("e") == "none: /metrics answers HTTP 404"
    warnings = [r for r in caplog.records if "lifetime mean" in r.getMessage()]
    assert len(warnings) == 1 and "--enable-metrics" in warnings[0].getMessage()


def test_a_local_resource_failure_keeps_the_last_state(caplog: pytest.LogCaptureFixture) -> None:
    failing = [False]

    def sglang(request: httpx.Request) -> httpx.Response:
        if failing[0]:
            raise httpx.ConnectError("connect failed") from OSError(
                errno.EMFILE, "Too many open files")
        if request.url.path == "/v1/loads":
            return loads(5, 2.0)
        return httpx.Response(200, text=sglang_metrics_text([5], [0], 2.0))

    lv, clock = view(), [10.0]
    poller = poller_for(sglang, lv, clock)

    async def run() -> None:
        await poller.poll_once(EAGLE)
        failing[0] = True
        for _ in range(5):
            clock[0] += 0.1
            assert await poller.poll_once(EAGLE) is None
    with caplog.at_level(logging.WARNING, "specrouter.observe.telemetry"):
        asyncio.run(run())
    # The source is kept (no search over every endpoint), nothing is published, and the
    # failure is logged once however often it repeats.
    assert poller.source_of("e") == "v1_loads" and poller.accept_status("e") == "metrics"
    local = [r for r in caplog.records if "router's side" in r.getMessage()]
    assert len(local) == 1 and "Too many open files" in local[0].getMessage()


def test_a_backend_without_load_endpoints_is_searched_slowly_until_one_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three requests a poll, ten polls a second, forever, would load a server that is
    down or serves none of SGLang's load endpoints: after SEARCH_MISSES empty polls the
    next comes SEARCH_INTERVAL_S later, and the interval is back once one answers."""
    serving = [False]
    asked: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if serving[0] and request.url.path == "/v1/loads":
            return loads(4, 2.0)
        return httpx.Response(404, json={"detail": "Not Found"})

    lv, clock = view(), [10.0]
    poller = poller_for(engine, lv, clock)

    async def run(polls: int) -> None:
        for _ in range(polls):
            clock[0] += 0.1
            await poller.poll_once(EAGLE)
    with caplog.at_level(logging.INFO, "specrouter.observe.telemetry"):
        asyncio.run(run(SEARCH_MISSES - 1))
        assert poller.delay("e") == poller.interval
        asyncio.run(run(1))
        assert poller.delay("e") == SEARCH_INTERVAL_S > poller.interval
        asyncio.run(run(3))
        assert poller.delay("e") == SEARCH_INTERVAL_S
        assert len(asked) == 3 * (SEARCH_MISSES + 3)  # each poll still searches all three
        serving[0] = True
        asyncio.run(run(1))
    assert poller.delay("e") == poller.interval and poller.source_of("e") == "v1_loads"
    assert lv.backends["e"].sample is not None and lv.backends["e"].sample.total == 4
    said = [r.getMessage() for r in caplog.records]
    slowed = [m for m in said if "answered none of" in m]
    assert len(slowed) == 1 and "/v1/loads, /get_load, /metrics" in slowed[0]
    assert [m for m in said if "read from /v1/loads again" in m]
