"""The default (online) strategy under a load its EAGLE-3 engine's KV pool cannot hold:
a simulated H200 group whose EAGLE-3 engine has a KV pool of 30,000 tokens (four requests
of 6,000 prompt tokens), far below its 48 batch slots, and 16 clients sending such
requests back to back. The engine queues with its pool full; the router learns that its
batch is bounded at about four, predicts the queue and moves the group to the baseline,
which the cost model alone (crossover ~60 requests at accept 3.0) never would. The
router runs with `telemetry.learn_kv_room` on (off by default)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from loadtest import loopback
from specrouter.routing.costsource import profile_model
from tests.fixtures.router import RouterFactory, group_backends
from tests.fixtures.sim import SimGroup

CLIENTS = 16
PROMPT_TOKENS = 6_000  # the simulator counts 4 characters a token
EAGLE_KV_TOKENS = 30_000
DEADLINE_S = 60.0
PROFILE = profile_model("h200-llama3-8b", 2048)


def _body(client: int, n: int, max_tokens: int = 300) -> dict[str, Any]:
    words = f"c{client}r{n} " * (PROMPT_TOKENS * 4 // len(f"c{client}r{n} "))
    return {"model": "default", "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens, "ignore_eos": True}


def test_a_kv_bound_eagle_engine_moves_the_online_router_to_the_baseline(
        sim_group: Any, router: RouterFactory) -> None:
    sim: SimGroup = sim_group(profile="h200-llama3-8b", time_scale=1.0, extra_args=(
        "--eagle-max-total-tokens", str(EAGLE_KV_TOKENS)))
    sim.control("eagle", accept_length=3.0)
    proc = router(group_backends(sim.eagle_url, sim.baseline_url), env={
        "SPECROUTER_POLICY": json.dumps({"strategy": "online"}),
        "SPECROUTER_COST_MODEL__PROFILE": "h200-llama3-8b",
        "SPECROUTER_COST_MODEL__CTX": "2048",
        "SPECROUTER_TELEMETRY__LEARN_KV_ROOM": "true",
    })

    async def scenario() -> dict[str, Any]:
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with loopback.async_client(timeout=120.0, limits=limits, trust_env=False) as client:
            async def worker(i: int) -> None:
                n = 0
                while not stop.is_set():
                    await client.post(f"{proc.v1}/chat/completions", json=_body(i, n))
                    n += 1

            workers = [asyncio.create_task(worker(i)) for i in range(CLIENTS)]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE_S
            try:
                while True:
                    group: dict[str, Any] = (await client.get(f"{proc.url}/policy")
                                             ).json()["groups"][0]
                    if group.get("choice") == "baseline":
                        return group
                    assert loop.time() < deadline, f"still on EAGLE-3: {group}"
                    await asyncio.sleep(0.1)
            finally:
                stop.set()
                await asyncio.gather(*workers, return_exceptions=True)

    group = asyncio.run(scenario())
    assert group["reason"] in ("online_burst", "online_baseline"), group
    caps = group["learned"]["batch_cap"]
    assert caps["eagle"]["engine"] == 48 and 2 <= caps["eagle"]["effective"] <= 6, caps
    assert caps["eagle"]["kv_room"] == caps["eagle"]["effective"]
    # the step costs alone (the engine's 48 slots) keep EAGLE-3 far beyond this load: the
    # predicted queue moved the group
    assert PROFILE.crossover(group["accept_length_used"]) > 40 > group["load"] + 1
    assert group["crossover"] < group["load"] + 1
