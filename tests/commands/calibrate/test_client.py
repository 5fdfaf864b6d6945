"""The calibration client against the simulator speaking SGLang 0.5.23: the accept length it
records for a level is the windowed /metrics gauge, not SGLang's lifetime mean."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from loadtest import loopback
from specrouter.commands.calibrate.client import LoadShape, PoolClient, read_accept_length
from specrouter.commands.calibrate.measure import LevelResult
from specrouter.observe.telemetry import parse_v1_loads
from tests.fixtures.sim import SimGroup

SHORT = LoadShape(64, 96, "sim")


async def _level(url: str, client: httpx.AsyncClient, requests: int,
                 shape: LoadShape = SHORT) -> None:
    pool = PoolClient(url, shape, None, client)
    result = LevelResult("eagle", 4)
    await asyncio.gather(*(pool.one(result) for _ in range(requests)))
    assert result.requests == requests


def test_a_level_reads_the_window_of_its_own_steps(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.02, sglang_version="0.5.23")
    url = group.url("eagle")

    async def run() -> tuple[float | None, float | None]:
        async with loopback.async_client(timeout=60.0) as client:
            group.control("eagle", accept_length=3.0)
            await _level(url, client, 12)
            group.control("eagle", accept_length=1.2)
            await _level(url, client, 8)
            loads = (await client.get(url + "/v1/loads?include=core,spec")).json()
            lifetime = parse_v1_loads(loads, 0.0).accept_lifetime
            return await read_accept_length(url, client), lifetime

    windowed, lifetime = asyncio.run(run())
    assert windowed is not None and windowed < 1.5, windowed
    assert lifetime is not None and lifetime > 1.6, lifetime  # the mean still holds level one


def test_every_request_pays_its_whole_prefill(sim_group: Callable[..., SimGroup]) -> None:
    """A calibration level measures the traffic it calibrates for: SGLang's radix cache
    holds no prefix of a calibration request, so the engine prefills every prompt whole
    (one repeated prompt would be served from cache after the first request)."""
    group = sim_group(time_scale=0.02, sglang_version="0.5.23")
    url = group.url("baseline")

    async def run() -> None:
        async with loopback.async_client(timeout=60.0) as client:
            for _ in range(2):
                await _level(url, client, 4, LoadShape(1000, 8, "sim"))

    asyncio.run(run())
    state = group.state("baseline")
    assert state["prompt_tokens"] > 8 * 900
    assert state["cached_tokens"] < 0.02 * state["prompt_tokens"], state
