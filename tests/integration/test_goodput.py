"""The goodput strategy end to end: a simulated H200 group (profile h200-llama3-8b), a
`specrouter serve` configured with that profile's cost model through the environment,
and a workload shift on the EAGLE engine (POST /sim/control accept_length) while a fixed
load is held. The group's choice follows the live accept length: EAGLE-3 at 3.0, the
baseline at 1.6, with /policy showing the smoothed accept length, both pools'
predictions at the current load and the crossover at that accept length."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest import loopback
from specrouter.routing.costmodel import GroupCostModel, model_from_dict
from specrouter.routing.costsource import profile_model
from specrouter.routing.strategies.registry import DEFAULT_STRATEGY
from tests.fixtures.procs import REPO_ROOT, specrouter_argv
from tests.fixtures.router import RouterFactory, group_backends
from tests.fixtures.sim import SimGroup
from tests.integration.conftest import ADMIN_TOKEN

# The cost model's crossover (chain 3/1/4, EAGLE cap 48) is 61.6 at accept 3.0 and 12.4
# at 1.6: a load of 28 lies well inside both regimes.
STREAMS = 28
MODEL = profile_model("h200-llama3-8b", 2048)
DEADLINE_S = 60.0


def test_model_puts_the_held_load_between_the_two_crossovers() -> None:
    low, high = MODEL.crossover(1.6), MODEL.crossover(3.0)
    assert low is not None and high is not None
    assert low + 5 < STREAMS + 1 < high - 5


async def _policy_group(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    view = (await client.get(f"{url}/policy")).json()
    group: dict[str, Any] = view["groups"][0]
    return group


async def _until(client: httpx.AsyncClient, url: str, what: str,
                 ok: Any) -> dict[str, Any]:
    """Poll GET /policy until `ok(group)` holds; fail with the last view at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while True:
        group = await _policy_group(client, url)
        if ok(group):
            return group
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}; /policy group: {group}")
        await asyncio.sleep(0.05)


def _check_report(group: dict[str, Any], accept_near: float) -> None:
    accept = group["accept_length"]
    assert abs(accept - accept_near) < 0.35, group
    assert group["accept_length_used"] == accept  # the live average, not the nominal 2.5
    preds = group["predictions"]
    assert set(preds) == {"eagle", "baseline"}
    assert all(p["load"] == group["load"] + 1 for p in preds.values())  # the new request joins
    for p in preds.values():
        assert p["throughput_tok_s"] > 0 and p["tpot_ms"] > 0
    # The served model is the profile's curves times factors learned from telemetry (seed
    # weight 64), so its crossover at the live accept length stays near the profile's.
    assert group["crossover"] == group["learned"]["crossover"]
    expected = MODEL.crossover(accept)
    assert expected is not None and abs(group["crossover"] - expected) < 0.1 * expected, group


def test_choice_follows_the_live_accept_length(sim_group: Any, router: RouterFactory) -> None:
    sim: SimGroup = sim_group(profile="h200-llama3-8b", time_scale=1.0)
    sim.control("eagle", accept_length=3.0)
    proc = router(group_backends(sim.eagle_url, sim.baseline_url), env={
        "SPECROUTER_POLICY": json.dumps({"strategy": "goodput"}),
        "SPECROUTER_COST_MODEL__PROFILE": "h200-llama3-8b",
        "SPECROUTER_COST_MODEL__CTX": "2048",
    })

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=STREAMS + 8)
        async with loopback.async_client(timeout=120.0, limits=limits, trust_env=False) as client:
            body = {"model": "default", "messages": [{"role": "user", "content": "go " * 50}],
                    "max_tokens": 8000, "ignore_eos": True}
            held = [asyncio.create_task(client.post(f"{proc.v1}/chat/completions", json=body))
                    for _ in range(STREAMS)]
            try:
                eagle = await _until(
                    client, proc.url, "the held load on EAGLE-3 at accept ~3.0",
                    lambda g: g["load"] >= STREAMS and g["accept_length"] is not None
                    and g["accept_length"] > 2.8)
                assert (eagle["choice"], eagle["reason"]) == ("eagle", "goodput_eagle"), eagle
                _check_report(eagle, 3.0)
                assert eagle["crossover"] > eagle["load"] + 1
                pred = eagle["predictions"]
                assert pred["eagle"]["throughput_tok_s"] > pred["baseline"]["throughput_tok_s"]

                sim.control("eagle", accept_length=1.6)
                base = await _until(client, proc.url, "the choice to flip to the baseline",
                                    lambda g: g["choice"] == "baseline")
                assert base["reason"] == "goodput_baseline" and base["load"] >= STREAMS - 1
                # The EWMA is still on its way down when the flip comes; it then settles.
                assert base["crossover"] < base["load"] + 1
                settled = await _until(client, proc.url, "the accept average to settle",
                                       lambda g: g["accept_length"] < 1.8)
                _check_report(settled, 1.6)
                pred = settled["predictions"]
                assert pred["baseline"]["throughput_tok_s"] > pred["eagle"]["throughput_tok_s"]
                assert pred["baseline"]["tpot_ms"] < pred["eagle"]["tpot_ms"]
                # A new request is decided by the model, and says so in its headers.
                oai = openai.AsyncOpenAI(base_url=proc.v1, api_key="unused", max_retries=0)
                raw = await oai.chat.completions.with_raw_response.create(
                    model="default", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4)
                assert raw.headers["x-specrouter-pool"] == "baseline"
                assert raw.headers["x-specrouter-reason"] == "goodput_baseline"
                assert raw.parse().choices[0].message.content
                await oai.close()
                assert all(not t.done() for t in held)  # the load was held throughout
            finally:
                for t in held:
                    t.cancel()
                await asyncio.gather(*held, return_exceptions=True)

    asyncio.run(scenario())


@pytest.mark.parametrize("strategy", ["goodput", None])
def test_calibrate_fits_writes_and_serves_the_cost_model(
    sim_group: Any, router: RouterFactory, tmp_path: Path, strategy: str | None,
) -> None:
    """`--strategy goodput`, and the default (the router's own, online), whose fitted
    model seeds the one the router learns from telemetry."""
    sim: SimGroup = sim_group(profile="seed-coding", time_scale=0.05)
    backends = group_backends(sim.eagle_url, sim.baseline_url)
    live = router(backends, env={"SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
    model_file, policy_file, sweep_file = (tmp_path / n for n in
                                           ("model.json", "policy.json", "sweep.json"))
    done = subprocess.run(
        specrouter_argv("calibrate", "--eagle-url", sim.eagle_url,
                        "--baseline-url", sim.baseline_url, "--concurrency", "1,2,4,8",
                        "--requests", "8", "--input-tokens", "200", "--output-tokens", "64",
                        *(("--strategy", strategy) if strategy else ()),
                        "--write-cost-model", str(model_file),
                        "--write-policy", str(policy_file), "--json", str(sweep_file),
                        "--router-url", live.url, "--admin-token", ADMIN_TOKEN, "--apply"),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cost model (accept length" in done.stdout and "cost model written" in done.stdout

    sweep = json.loads(sweep_file.read_text())
    model = model_from_dict(json.loads(model_file.read_text()))
    # Fitted at the accept length the EAGLE server reported during the sweep, with both
    # servers' max running requests (seed-coding: the simulator's 48 and 256).
    assert sweep["accept_length"] is not None and sweep["accept_length"] > 1.0
    assert model.nominal_accept_length == sweep["accept_length"]
    assert (model.eagle_max_batch, model.baseline_max_batch) == (48, 256)
    # The table fit reproduces the measured EAGLE/baseline ratio at every level.
    for e, b in zip(sweep["levels"]["eagle"], sweep["levels"]["baseline"], strict=True):
        measured = e["throughput_tok_s"] / b["throughput_tok_s"]
        assert abs(model.ratio(e["concurrency"], model.nominal_accept_length) - measured) < 0.01
    assert f"crossover at {_fmt_crossover(model)}" in done.stdout

    name = strategy or DEFAULT_STRATEGY
    assert json.loads(policy_file.read_text())["strategy"] == name
    applied = loopback.get(f"{live.url}/policy", timeout=5.0).json()
    assert (applied["policy"]["strategy"], applied["policy"]["version"]) == (name, 2)

    # A router started from the two files predicts with the fitted model.
    served = router(backends, env={"SPECROUTER_COST_MODEL__FILE": str(model_file)},
                    extra_args=("--policy-file", str(policy_file)))

    async def reported() -> dict[str, Any]:
        async with loopback.async_client(timeout=5.0, trust_env=False) as client:
            return await _until(client, served.url, "an accept length from telemetry",
                                lambda g: g["accept_length"] is not None)

    group = asyncio.run(reported())
    assert group["reason"].startswith(f"{name}_") and group["reason"] != f"{name}_no_model"
    if name == "goodput":  # the online model moves off its seed as telemetry arrives
        assert group["crossover"] == model.crossover(group["accept_length"])
    assert set(group["predictions"]) == {"eagle", "baseline"}


def _fmt_crossover(model: GroupCostModel) -> str:
    x = model.crossover(model.nominal_accept_length)
    return "never (EAGLE-3 ahead)" if x is None else f"{x:.1f}"


def test_shadow_probe_reaches_the_idle_eagle_server_and_the_client_keeps_the_baseline(
    sim_group: Any, router: RouterFactory,
) -> None:
    # The workload accepted 3.5 on EAGLE-3, then falls to 1.6. seed-coding's model puts
    # the crossover at 0 at 1.6 and 25 at 3.5: with two requests held on the baseline
    # (client override) the group stays there, its EAGLE server idle, and a probe could
    # win EAGLE-3 back if the accept length rose again.
    sim: SimGroup = sim_group(profile="seed-coding", time_scale=0.05)
    proc = router(group_backends(sim.eagle_url, sim.baseline_url), env={
        "SPECROUTER_POLICY": json.dumps({"strategy": "goodput", "goodput_probe_s": 0.2,
                                         "goodput_probe_tokens": 40,
                                         "allow_client_override": True}),
        "SPECROUTER_COST_MODEL__PROFILE": "seed-coding", "SPECROUTER_COST_MODEL__CTX": "1024",
        # polls on the simulated clock, as the benchmarks run them: 0.1 s x time scale
        "SPECROUTER_TELEMETRY__INTERVAL_S": "0.005",
    })

    def chat(max_tokens: int) -> dict[str, Any]:
        return {"model": "default", "messages": [{"role": "user", "content": "refactor"}],
                "max_tokens": max_tokens, "ignore_eos": True}

    async def scenario() -> None:
        async with loopback.async_client(timeout=60.0, trust_env=False) as client:
            on_eagle = {"x-specrouter-pool": "eagle"}
            # Long enough that the router has seen the 3.5 well: its trend's peak needs
            # ~10 readings' worth of evidence, and one engine snapshot of 4 requests
            # counts 15/40 of one (~38 snapshots in 2000 tokens at 3.5).
            for accept, tokens in ((3.5, 2000), (1.6, 800)):
                sim.control("eagle", accept_length=accept)
                await asyncio.gather(*(client.post(
                    f"{proc.v1}/chat/completions", json=chat(tokens), headers=on_eagle)
                    for _ in range(4)))
            await _until(client, proc.url, "the accept average to fall",
                         lambda g: g["accept_length"] is not None and g["accept_length"] < 2.2)
            before = sim.state("eagle")
            held = [asyncio.create_task(client.post(
                f"{proc.v1}/chat/completions", json=chat(100000),
                headers={"x-specrouter-pool": "baseline"})) for _ in range(2)]
            try:
                await _until(client, proc.url, "the held load", lambda g: g["load"] >= 2)
                oai = openai.AsyncOpenAI(base_url=proc.v1, api_key="unused", max_retries=0)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + DEADLINE_S
                while sim.state("eagle")["admitted"] == before["admitted"]:
                    assert loop.time() < deadline, "no probe reached the EAGLE server"
                    raw = await oai.chat.completions.with_raw_response.create(
                        model="default", messages=[{"role": "user", "content": "refactor"}],
                        max_tokens=300, stream=True, extra_body={"ignore_eos": True})
                    assert raw.headers["x-specrouter-pool"] == "baseline"
                    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse()
                                    if c.choices])
                    assert text  # the client's own answer streamed from the baseline
                await oai.close()
                # The probe: one request, cut to goodput_probe_tokens, and then released.
                while (sim.state("eagle")["finished"] == before["finished"]
                       or proc.inflight()["gpu0-eagle"]):
                    assert loop.time() < deadline, "the probe never finished"
                    await asyncio.sleep(0.02)
                eagle = sim.state("eagle")
                assert eagle["admitted"] - before["admitted"] == 1
                assert eagle["generated_tokens"] - before["generated_tokens"] == 40
                metrics = (await client.get(f"{proc.url}/metrics")).text
                assert 'specrouter_probes_total{backend="gpu0-eagle"} 1.0' in metrics
            finally:
                for t in held:
                    t.cancel()
                await asyncio.gather(*held, return_exceptions=True)

    asyncio.run(scenario())
