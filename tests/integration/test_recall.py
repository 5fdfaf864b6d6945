"""Recall end to end: when a group switches to the baseline, its EAGLE-3 streams that have
not sent a first byte move to the baseline server; streams already answering stay.

One simulated group behind `specrouter serve`, the real openai client. The EAGLE engine is
made to hold requests without answering (the simulator's `stall` fault), which is what a
request queued behind a full batch looks like from the router: no byte yet.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.procs import wait_until
from tests.fixtures.router import RoutedGroup

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Exact loads (in-flight), EAGLE-3 at 0-1 in flight, the baseline from 2 on.
POLICY = {"strategy": "threshold", "switch_up": 2, "switch_down": 0, "load_signal": "inflight"}
ENV = {"SPECROUTER_POLICY": json.dumps(POLICY), "SPECROUTER_ADMISSION__ARRIVAL_WINDOW_MS": "0"}


def _recalls(group: RoutedGroup) -> float:
    text = httpx.get(f"{group.router.url}/metrics", timeout=5.0).text
    for family in text_string_to_metric_families(text):
        if family.name == "specrouter_recalls":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no specrouter_recalls series in /metrics")


async def _story(client: openai.AsyncOpenAI, tokens: int,
                 answering: asyncio.Event | None = None) -> tuple[str, str]:
    """One streamed chat completion read to the end: (pool header, text). `answering` is
    set when its first chunk arrived."""
    text = []
    async with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "a story"}], stream=True,
        max_tokens=tokens, extra_body={"ignore_eos": True},
    ) as response:
        async for chunk in await response.parse():
            if answering is not None:
                answering.set()
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
        return response.headers["x-specrouter-pool"], "".join(text)


def test_a_switch_to_the_baseline_recalls_eagle_streams_without_a_first_byte(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    group = routed_group(time_scale=0.02, router_env=ENV)
    group.control("eagle", stall=True)  # EAGLE-3 takes requests and never answers

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=group.router.v1, api_key="none",
                                      max_retries=0, timeout=30.0) as client:
            held = []
            for expected in (1, 2):  # load 0, then 1: both go to EAGLE-3 and wait there
                held.append(asyncio.create_task(_story(client, 20)))
                await asyncio.to_thread(
                    wait_until, lambda n=expected: group.router.inflight()["gpu0-eagle"] == n, 10.0,
                    f"{expected} streams held on EAGLE-3")
            # load 2: the group switches to the baseline and the held two follow
            results = await asyncio.gather(_story(client, 20), *held)
        assert [pool for pool, _ in results] == ["baseline"] * 3
        assert all(text for _, text in results)

    asyncio.run(scenario())
    assert _recalls(group) == 2
    group.router.wait_idle()
    assert group.state("baseline")["finished"] == 3


def test_streams_already_answering_stay_on_eagle_after_the_switch(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    group = routed_group(time_scale=0.05, router_env=ENV)

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=group.router.v1, api_key="none",
                                      max_retries=0, timeout=60.0) as client:
            answering = [asyncio.Event(), asyncio.Event()]
            held = []
            for event in answering:  # load 0, then 1: EAGLE-3, answering for seconds
                held.append(asyncio.create_task(_story(client, 400, event)))
                await asyncio.wait_for(event.wait(), 10.0)
            switching = await _story(client, 8)
            assert switching[0] == "baseline"
            assert [pool for pool, _ in await asyncio.gather(*held)] == ["eagle"] * 2

    asyncio.run(scenario())
    assert _recalls(group) == 0
