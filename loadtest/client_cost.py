"""Why loadtest has its own client: client CPU per streamed request, three ways.

    python -m loadtest.client_cost

Starts one simulated group (seed-coding, --time-scale 0.1) and sends the same 256
requests (1000 input, 256 output tokens) at concurrency 64 to its baseline engine with
loadtest's raw HTTP/1.1 client, with httpx streaming (`aiter_lines` + json per event),
and with the `openai` SDK (a pydantic object per chunk); prints this process's CPU per
request for each. The generator shares the cores with the simulator and the router, so
its own cost is part of what a benchmark on 2 cores measures.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx

from loadtest import loopback
from loadtest.generator import LoadGenerator
from loadtest.procs import Stack, served_model
from loadtest.promptset import PromptCycler, RequestShape, build_body, load_prompts
from loadtest.scenarios.common import run_async

REQUESTS, CONCURRENCY = 256, 64


async def _users(one: Callable[[], Awaitable[None]]) -> None:
    sent = 0

    async def user() -> None:
        nonlocal sent
        while sent < REQUESTS:
            sent += 1
            await one()

    await asyncio.gather(*(user() for _ in range(CONCURRENCY)))


async def raw_client(url: str, shape: RequestShape) -> None:
    async with LoadGenerator(url, shape, load_prompts(), progress=False) as gen:
        await gen.closed_loop(CONCURRENCY, num_requests=REQUESTS)


def _http() -> httpx.AsyncClient:
    return loopback.async_client(limits=httpx.Limits(max_connections=CONCURRENCY + 8),
                             timeout=600.0)


async def httpx_client(url: str, shape: RequestShape) -> None:
    prompts = PromptCycler(load_prompts())
    async with _http() as client:
        async def one() -> None:
            body = build_body(prompts.next(), shape)
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        json.loads(line[5:])

        await _users(one)


async def openai_client(url: str, shape: RequestShape) -> None:
    import openai

    prompts = PromptCycler(load_prompts())
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=600.0) as client:
        async def one() -> None:
            body = build_body(prompts.next(), shape)
            stream = await client.chat.completions.create(
                model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for _ in stream:
                pass

        await _users(one)


def main() -> int:
    with Stack() as stack:
        sim = stack.sim_group("gpu0", "seed-coding", 0.1)
        shape = RequestShape(served_model(sim.baseline_url), 1000, 256)
        for name, job in (("raw", raw_client), ("httpx", httpx_client),
                          ("openai", openai_client)):
            wall, cpu = time.perf_counter(), time.process_time()
            run_async(job(sim.baseline_url, shape))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"{name:7s} {REQUESTS} requests x {shape.output_tokens} tokens at "
                  f"c={CONCURRENCY}: wall {wall:.1f} s, client CPU {cpu:.2f} s = "
                  f"{cpu / REQUESTS * 1e3:.2f} ms/request, {cpu / wall:.2f} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
