"""SGLang's queue-full answers and late aborts, end to end through `specrouter serve`
against the simulator speaking each SGLang release.

A full queue answers a stream with HTTP 200 and one error event (code 503): the router
must retry it elsewhere, as it does an HTTP 503. A client that leaves a queued request is
noticed by SGLang only at its 4 s poll: the router aborts the request by its rid at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.router import RouterFactory, RouterProc
from tests.fixtures.sim import SimEngine

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VERSIONS = ("0.5.23", "0.5.10")
STORY = {"model": MODEL, "messages": [{"role": "user", "content": "a story"}]}
FAST_HEALTH = {"interval_s": 0.2, "ready_timeout_s": 1.0, "health_timeout_s": 1.0}


def _router(router: RouterFactory, eagle: SimEngine, baseline: SimEngine,
            **env: str) -> RouterProc:
    backends = [{"name": "e", "url": eagle.url, "pool": "eagle", "group": "g"},
                {"name": "b", "url": baseline.url, "pool": "baseline", "group": "g"}]
    proc = router(backends, env={"SPECROUTER_HEALTH": json.dumps(FAST_HEALTH), **env})
    wait_until(lambda: all(b["healthy"] for b in proc.ready()["backends"]), 20.0,
               "both backends healthy")
    return proc


def _queue(engine: SimEngine) -> tuple[int, int]:
    state = engine.state()
    return state["running"], state["waiting"]


def _upstream_errors(proc: RouterProc, backend: str) -> float:
    text = loopback.get(f"{proc.url}/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        if family.name == "specrouter_upstream_errors":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_total") and s.labels["backend"] == backend)
    return 0.0


@pytest.mark.parametrize("version", VERSIONS)
def test_a_queue_full_stream_reaches_the_client_as_a_complete_answer(
    version: str, sim_engine: Callable[..., SimEngine], router: RouterFactory,
) -> None:
    # one request runs, one waits: the EAGLE-3 server's queue is full
    full = sim_engine("eagle", sglang_version=version, extra_args=(
        "--max-running-requests", "1", "--max-queued-requests", "1"))
    proc = _router(router, full, sim_engine("baseline", sglang_version=version),
                   SPECROUTER_POLICY=json.dumps({"mode": "eagle"}))

    async def scenario() -> None:
        async with loopback.async_client(base_url=full.url, timeout=60.0) as direct:
            fillers: list[asyncio.Task[httpx.Response]] = []
            while len(fillers) < 20 and _queue(full) != (1, 1):
                # the router's health checks also pass through the queue: fill until full
                fillers.append(asyncio.create_task(direct.post("/v1/chat/completions", json={
                    **STORY, "max_tokens": 4000, "ignore_eos": True})))
                await asyncio.sleep(0.2)
            answer = await direct.post("/v1/chat/completions", json={**STORY, "stream": True})
            assert answer.status_code == 200  # SGLang's queue-full answer to a stream
            event = json.loads(answer.text.split("\n", 1)[0].removeprefix("data: "))
            assert event["error"]["code"] == 503
            try:
                await through_the_router()
            finally:
                for filler in fillers:
                    filler.cancel()
                await asyncio.gather(*fillers, return_exceptions=True)

    async def through_the_router() -> None:
        async with openai.AsyncOpenAI(base_url=proc.v1, api_key="none", max_retries=0,
                                      timeout=30.0) as client:
            async with client.chat.completions.with_streaming_response.create(
                **STORY, stream=True, max_tokens=8, extra_body={"ignore_eos": True},
            ) as response:
                text = "".join([c.choices[0].delta.content or ""
                                async for c in await response.parse() if c.choices])
                assert response.headers["x-specrouter-backend"] == "b"
            assert len(text.split()) >= 4
            plain = await client.chat.completions.with_raw_response.create(**STORY, max_tokens=4)
            assert plain.headers["x-specrouter-backend"] == "b"  # HTTP 503, retried as before
            assert plain.parse().choices[0].message.content

    asyncio.run(scenario())
    assert _upstream_errors(proc, "e") == 2  # both went to the EAGLE-3 server first
    proc.wait_idle()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_client_that_leaves_a_queued_request_gets_it_aborted_at_once(
    version: str, sim_engine: Callable[..., SimEngine], router: RouterFactory,
) -> None:
    # time scale 1: SGLang's own 4 s poll takes 4 real seconds
    eagle = sim_engine("eagle", sglang_version=version, time_scale=1.0)
    proc = _router(router, eagle, sim_engine("baseline", sglang_version=version, time_scale=1.0),
                   SPECROUTER_POLICY=json.dumps({"mode": "eagle"}))
    eagle.control(wedged=True)  # requests wait in the queue: no byte, no head

    async def leave_while_queued() -> float:
        async with loopback.async_client(base_url=proc.url, timeout=30.0) as client:
            task = asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "stream": True}))
            # `requests` counts clients' requests only: the router's /health also queues a
            # one-token request on a wedged 0.5.10 server, and may be the first to wait
            await asyncio.to_thread(wait_until, lambda: eagle.state()["requests"] == 1, 10.0,
                                    "the request queued on the EAGLE-3 server")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return time.monotonic()

    left = asyncio.run(leave_while_queued())
    wait_until(lambda: eagle.state()["aborted"] == 1, 10.0, "the queued request aborted")
    aborted_after = eagle.state()["abort_times"][-1] - left
    assert aborted_after < 1.0, aborted_after  # not SGLang's 4 s poll
    wait_until(lambda: proc.inflight()["e"] == 0, 2.0, "the abort acknowledged")
