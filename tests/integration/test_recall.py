"""Recall and handover end to end: when a group switches to the baseline, its EAGLE-3
streams that have not sent a first byte move to the baseline server; streams already
answering are handed over and continue there as one stream.

One simulated group behind `specrouter serve`, the real openai client. The EAGLE engine is
made to hold requests without answering (the simulator's `stall` fault), which is what a
request queued behind a full batch looks like from the router: no byte yet.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import openai

from tests.fixtures.procs import wait_until
from tests.fixtures.router import RoutedGroup

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Exact loads (in-flight), EAGLE-3 at 0-1 in flight, the baseline from 2 on.
POLICY = {"strategy": "threshold", "switch_up": 2, "switch_down": 0, "load_signal": "inflight"}
ENV = {"SPECROUTER_POLICY": json.dumps(POLICY), "SPECROUTER_ADMISSION__ARRIVAL_WINDOW_MS": "0"}


def _recalls(group: RoutedGroup) -> float:
    return group.counted("specrouter_recalls")


def _handovers(group: RoutedGroup) -> float:
    return group.counted("specrouter_handovers")


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


async def _chunks(client: openai.AsyncOpenAI, tokens: int, answering: asyncio.Event,
                  ) -> list[Any]:
    """Every chunk of one streamed chat completion with usage; `answering` is set at the
    first."""
    chunks = []
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long story"}], stream=True,
        max_tokens=tokens, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        answering.set()
        chunks.append(chunk)
    return chunks


def _answer_then_switch(group: RoutedGroup, tokens: int) -> list[list[Any]]:
    """Two streams answering on EAGLE-3 (loads 0 and 1), then a third request switches
    the group to the baseline; the two streams' chunks."""

    async def scenario() -> list[list[Any]]:
        async with openai.AsyncOpenAI(base_url=group.router.v1, api_key="none",
                                      max_retries=0, timeout=60.0) as client:
            answering = [asyncio.Event(), asyncio.Event()]
            held = []
            for event in answering:
                held.append(asyncio.create_task(_chunks(client, tokens, event)))
                await asyncio.wait_for(event.wait(), 10.0)
            switching = await _story(client, 8)
            assert switching[0] == "baseline"
            return list(await asyncio.gather(*held))

    return asyncio.run(scenario())


def test_a_switch_hands_streams_already_answering_over_to_the_baseline(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    group = routed_group(time_scale=0.05, router_env=ENV)
    streams = _answer_then_switch(group, 400)
    for chunks in streams:
        # one stream to the client: one id, one role chunk, one finish, usage last
        assert len({c.id for c in chunks}) == 1
        roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
        assert len(roles) == 1 and chunks[0] is roles[0]
        finishes = [c.choices[0].finish_reason for c in chunks
                    if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        # the tokens sent before the handover are estimated (events x accept length)
        assert 300 <= usage.completion_tokens <= 500
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _handovers(group) == 2
    group.router.wait_idle()
    eagle, baseline = group.state("eagle"), group.state("baseline")
    assert eagle["aborted"] == 2 and eagle["finished"] == 0
    assert baseline["finished"] == 3  # the switching request and both continuations


def test_with_handovers_off_streams_already_answering_stay_on_eagle(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    env = {**ENV, "SPECROUTER_ADMISSION__HANDOVER_MAX_TOKENS": "0"}
    group = routed_group(time_scale=0.05, router_env=env)
    streams = _answer_then_switch(group, 400)
    assert all(c.usage is not None and c.usage.completion_tokens == 400
               for c in (chunks[-1] for chunks in streams))
    assert _recalls(group) == 0 and _handovers(group) == 0
    group.router.wait_idle()
    assert group.state("eagle")["finished"] == 2


def test_a_switch_back_to_eagle_hands_a_baseline_stream_over_there(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    # EAGLE-3 at loads 0-1, the baseline from 2 on. Two streams pinned to EAGLE-3 (never
    # recalled) make the load 2, so a long stream moves the group to the baseline; once
    # the pinned two are gone, a request at load 1 moves the group back and the long
    # stream follows it to EAGLE-3.
    back = {**POLICY, "switch_down": 1, "allow_client_override": True}
    env = {**ENV, "SPECROUTER_POLICY": json.dumps(back)}
    group = routed_group(time_scale=0.1, router_env=env)

    async def scenario() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=group.router.v1, api_key="none",
                                      max_retries=0, timeout=60.0) as client:
            pinned = client.with_options(default_headers={"x-specrouter-pool": "eagle"})
            load = [asyncio.create_task(_chunks(pinned, 3000, asyncio.Event()))
                    for _ in range(2)]
            await asyncio.to_thread(wait_until, lambda: group.router.inflight() == {
                "gpu0-eagle": 2, "gpu0-baseline": 0}, 10.0, "two pinned streams")
            answering = asyncio.Event()
            long = asyncio.create_task(_chunks(client, 3000, answering))
            await asyncio.wait_for(answering.wait(), 10.0)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            await asyncio.to_thread(wait_until, lambda: group.router.inflight() == {
                "gpu0-eagle": 0, "gpu0-baseline": 1}, 10.0, "the long stream alone")
            handed_before = _handovers(group)
            pool, _ = await _story(client, 8)
            assert pool == "eagle"
            chunks = await long
            assert _handovers(group) == handed_before + 1
            return chunks

    chunks = asyncio.run(scenario())
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and 2500 <= usage.completion_tokens <= 3500
    group.router.wait_idle()
    assert group.state("baseline")["aborted"] == 1  # the long stream's first attempt
