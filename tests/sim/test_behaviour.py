"""Load behaviour over real HTTP: aborts, admission, the shared GPU, faults, determinism,
and a time-scaled closed-loop sweep against the seed-coding targets."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.sim import SimEngine, SimGroup

PROMPT_1000 = "x" * 4000  # 1000 prompt tokens at the profiles' 4 characters per token


def _completion(url: str, max_tokens: int, prompt: str = "hi", **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    response = loopback.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def test_disconnect_of_a_running_stream_frees_the_slot(sim_engine: Callable[..., SimEngine]
                                                      ) -> None:
    # 0.5.23 (the default) aborts a running stream at once; the queued request takes its slot
    engine = sim_engine("eagle", time_scale=0.2, extra_args=("--max-running-requests", "1"))
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100000,
            "ignore_eos": True, "stream": True}
    second_started = threading.Event()

    def second_stream() -> None:
        with loopback.client(timeout=30) as client, client.stream(
                "POST", f"{engine.url}/v1/chat/completions", json=body) as response:
            next(response.iter_lines())  # the head and the role chunk: it runs
            second_started.set()

    with loopback.client(timeout=30) as first, \
            first.stream("POST", f"{engine.url}/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()  # keep a reference: a dropped iterator closes the stream
        next(lines)  # the role chunk: the request is running
        worker = threading.Thread(target=second_stream)
        worker.start()
        wait_until(lambda: engine.state()["waiting"] == 1, 10, "second request queued")
        state = engine.state()
        assert state["running"] == 1 and state["admitted"] == 1
        closed_at = time.monotonic()
        stream.close()
        first.close()
        wait_until(lambda: engine.state()["aborted"] >= 1, 10, "abort counted")
        # "At once": well inside a second, where finishing its 100000 tokens would take minutes
        assert engine.state()["abort_times"][0] - closed_at < 1.0
        assert second_started.wait(10), "queued request admitted"
        worker.join(10)
    wait_until(lambda: engine.state()["aborted"] == 2, 10, "second abort counted")
    metrics = loopback.get(f"{engine.url}/metrics").text
    assert any(line.startswith("sglang:num_aborted_requests_total") and line.endswith(" 2.0")
               for line in metrics.splitlines())


def test_a_queued_stream_sends_no_byte_until_its_first_output(
        sim_engine: Callable[..., SimEngine]) -> None:
    # SGLang sends the response head with the first output: a queued stream sends nothing,
    # not even its head.
    engine = sim_engine("eagle", time_scale=0.2, extra_args=("--max-running-requests", "1"))
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100000,
            "ignore_eos": True, "stream": True}
    quick = httpx.Timeout(30, read=0.3)
    with loopback.client(timeout=30) as first, loopback.client(timeout=quick) as second, \
            first.stream("POST", f"{engine.url}/v1/chat/completions", json=body) as running:
        lines = running.iter_lines()
        next(lines)
        with pytest.raises(httpx.ReadTimeout):
            second.post(f"{engine.url}/v1/chat/completions", json=body)
        assert engine.state()["waiting"] == 1


def test_non_stream_disconnect_aborts(sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("baseline", time_scale=0.2)
    with pytest.raises(httpx.ReadTimeout):
        loopback.post(f"{engine.url}/v1/completions", timeout=0.5,
                   json={"model": "m", "prompt": "p", "max_tokens": 100000, "ignore_eos": True})
    wait_until(lambda: engine.state()["aborted"] == 1, 10, "abort counted")
    assert engine.state()["running"] == 0


def _e2e_sim_seconds(url: str, tokens: int) -> float:
    out = loopback.post(f"{url}/generate", timeout=60, json={
        "text": "q", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}).json()
    latency: float = out["meta_info"]["e2e_latency"]
    return latency


def test_shared_gpu_interference(sim_group: Callable[..., SimGroup]) -> None:
    """Baseline load on the same GPU slows the EAGLE engine: steps are time-sliced."""
    group = sim_group(time_scale=0.05)
    alone = _e2e_sim_seconds(group.eagle_url, 60)
    assert group.state("eagle")["gpu_busy_sim_s"] == pytest.approx(
        group.state("eagle")["busy_sim_s"], rel=0.05)

    async def load() -> float:
        async with loopback.async_client(timeout=120) as client:
            body = {"model": "m", "prompt": "p", "max_tokens": 100000, "ignore_eos": True}
            tasks = [asyncio.create_task(client.post(f"{group.baseline_url}/v1/completions",
                                                     json=body)) for _ in range(32)]
            await asyncio.to_thread(wait_until,
                                    lambda: group.state("baseline")["running"] == 32, 30)
            shared = await asyncio.to_thread(_e2e_sim_seconds, group.eagle_url, 60)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return shared

    shared = asyncio.run(load())
    # EAGLE step ~39 ms alone; with a 32-request baseline step (~49 ms) interleaved: ~2.2x
    assert shared / alone > 1.6, (alone, shared)
    wait_until(lambda: group.state("baseline")["running"] == 0, 10, "baseline drained")


def test_same_seed_same_output(sim_group: Callable[..., SimGroup]) -> None:
    first = sim_group(seed=7)
    a = _completion(first.eagle_url, 30, "same prompt")["choices"][0]["text"]
    assert _completion(first.eagle_url, 30, "same prompt")["choices"][0]["text"] == a
    assert _completion(first.baseline_url, 30, "same prompt")["choices"][0]["text"] == a
    assert _completion(first.eagle_url, 30, "other prompt")["choices"][0]["text"] != a
    again = sim_group(seed=7)
    assert _completion(again.eagle_url, 30, "same prompt")["choices"][0]["text"] == a
    other = sim_group(seed=8)
    assert _completion(other.eagle_url, 30, "same prompt")["choices"][0]["text"] != a


def test_control_faults(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.02)
    url = group.baseline_url
    group.control("baseline", error_rate=1.0)
    failed = loopback.post(f"{url}/v1/completions", json={"model": "m", "prompt": "p"})
    assert failed.status_code == 500 and failed.json()["object"] == "error"
    group.control("baseline", error_rate=0.0, added_latency_ms=300)
    started = time.monotonic()
    _completion(url, 2)
    assert time.monotonic() - started >= 0.3
    group.control("baseline", added_latency_ms=0, stall=True)
    with pytest.raises(httpx.ReadTimeout):
        loopback.post(f"{url}/v1/completions", json={"model": "m", "prompt": "p"}, timeout=0.5)
    group.control("baseline", stall=False, cut_stream_after_tokens=5)
    with pytest.raises(httpx.RemoteProtocolError), loopback.stream(
            "POST", f"{url}/v1/completions", timeout=30,
            json={"model": "m", "prompt": "p", "max_tokens": 50, "stream": True}) as response:
        list(response.iter_lines())
    group.control("baseline", cut_stream_after_tokens=None, slow_health_ms=400)
    started = time.monotonic()
    assert loopback.get(f"{url}/ready", timeout=5).status_code == 200
    assert time.monotonic() - started >= 0.4
    group.control("baseline", slow_health_ms=0, refuse_connections=True)
    with pytest.raises(httpx.ConnectError):
        loopback.get(f"{url}/v1/models", timeout=2)
    assert loopback.get(f"{group.eagle_url}/v1/models").status_code == 200  # per engine
    group.control("baseline", refuse_connections=False)  # through the eagle engine's port
    assert loopback.get(f"{url}/v1/models").status_code == 200
    group.control("baseline", refuse_connections=0.3)  # reopens by itself after 0.3 s
    with pytest.raises(httpx.ConnectError):
        loopback.get(f"{url}/v1/models", timeout=2)
    wait_until(lambda: _answers(f"{url}/v1/models"), 10, "port reopened")
    assert group.state("baseline")["faults"]["refuse_connections"] is False
    bad = loopback.post(f"{url}/sim/control", json={"error_rate": 2})
    assert bad.status_code == 400
    assert loopback.post(f"{url}/sim/control", json={"nonsense": 1}).status_code == 400


def _answers(url: str) -> bool:
    try:
        return loopback.get(url, timeout=2).status_code == 200
    except httpx.ConnectError:
        return False


def test_accept_length_control_and_schedule(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.02)
    assert group.state("eagle")["accept_length"] == 2.0
    group.control("eagle", accept_length=3.5)
    assert group.state("eagle")["accept_length"] == 3.5
    _completion(group.eagle_url, 400)
    observed = group.state("eagle")["observed_accept_length"]
    assert observed == pytest.approx(3.5, abs=0.35)
    loads = loopback.get(f"{group.eagle_url}/v1/loads").json()["loads"][0]
    assert loads["speculative"]["accept_length"] == pytest.approx(3.5, abs=0.35)
    # schedule in simulated seconds since the call: 1.2 now, 3.0 from t=20 s (0.4 s real)
    group.control("eagle", accept_length_schedule=[[0, 1.2], [20, 3.0]])
    assert group.state("eagle")["accept_length"] == 1.2
    wait_until(lambda: group.state("eagle")["accept_length"] == 3.0, 10, "schedule step")
    assert loopback.post(f"{group.eagle_url}/sim/control",
                      json={"accept_length": 9}).status_code == 400


def test_reseed_replays_the_same_draws(sim_group: Callable[..., SimGroup]) -> None:
    # Benchmarks reseed before each level so every config sees the same acceptance draws.
    group = sim_group(time_scale=0.02)

    def steps_of_one_request() -> int:
        before = group.state("eagle")["decode_steps"]
        _completion(group.eagle_url, 300)
        steps: int = group.state("eagle")["decode_steps"] - before
        return steps

    group.control("eagle", seed=11)
    first = steps_of_one_request()
    group.control("eagle", seed=11)
    assert steps_of_one_request() == first
    assert loopback.post(f"{group.eagle_url}/sim/control", json={"seed": "x"}).status_code == 400


async def _steady_closed_loop(group: SimGroup, pool: str, concurrency: int,
                              round_sim_s: float, time_scale: float) -> tuple[float, float]:
    """Closed loop with client starts spread over one round, as a long-running benchmark
    settles into: finishes then come one at a time, so the test client's turnaround (real
    milliseconds, many simulated seconds at a small time scale) leaves at most a slot or two
    empty instead of draining the whole batch every round. Measured from the moment every
    client has finished once over two rounds of simulated GPU time, so only steady state
    counts; throughput is output tokens per simulated GPU-busy second (/sim/state), which a
    busy CPU does not change. Also returns how full the decode batch was over the same
    span (mean batch / the most the engine runs at this concurrency): well below 1 the
    test client, not the engine, set the pace."""
    url = group.url(pool)
    body = {"model": "m", "prompt": PROMPT_1000, "max_tokens": 256, "ignore_eos": True}
    warm_clients = [0]
    all_warm, done = asyncio.Event(), asyncio.Event()
    gap = round_sim_s * time_scale / concurrency

    # every client keeps its connection: churning connections stalls the loop far more
    # than the engine's own turnaround
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with loopback.async_client(timeout=120, limits=limits) as c:
        async def client(i: int) -> None:
            await asyncio.sleep(i * gap)
            while not done.is_set():
                (await c.post(f"{url}/v1/completions", json=body)).raise_for_status()
                warm_clients[0] += 1
                if warm_clients[0] == concurrency:
                    all_warm.set()

        async def measure() -> tuple[float, float]:
            await all_warm.wait()
            before = await asyncio.to_thread(group.state, pool)
            while True:
                await asyncio.sleep(0.05)
                after = await asyncio.to_thread(group.state, pool)
                busy = after["busy_sim_s"] - before["busy_sim_s"]
                if busy >= 2 * round_sim_s:
                    done.set()
                    tokens = after["generated_tokens"] - before["generated_tokens"]
                    steps = max(1, after["decode_steps"] - before["decode_steps"])
                    per_request_step = after["observed_accept_length"] or 1.0
                    batch = tokens / steps / per_request_step
                    full = min(concurrency, after["max_running_requests"])
                    return float(tokens / busy), float(batch / full)

        clients = [asyncio.create_task(client(i)) for i in range(concurrency)]
        measured = await measure()
        await asyncio.gather(*clients)
    return measured


def _held_closed_loop(sim_group: Callable[..., SimGroup], pool: str, concurrency: int,
                      round_sim_s: float) -> float:
    """Throughput of `_steady_closed_loop` on a fresh group, at the fastest simulated clock
    at which this machine's test client keeps the batch 90% full: a loaded CI machine turns
    requests around slower, and at a fast clock the engine then decodes a smaller batch
    than the test means to measure (CI once saw 261 tok/s, about 10 requests' worth, at
    time scale 0.04)."""
    fill = 0.0
    for scale in (0.04, 0.1, 0.25):
        group = sim_group(time_scale=scale)
        throughput, fill = asyncio.run(
            _steady_closed_loop(group, pool, concurrency, round_sim_s, scale))
        group.process.stop()
        if fill >= 0.9:
            return throughput
    raise AssertionError(f"the test client kept the {pool} batch only {fill:.0%} full at "
                         f"concurrency {concurrency}, even at time scale 0.25")


def test_http_sweep_seed_coding_concurrency_64(sim_group: Callable[..., SimGroup]) -> None:
    # one request's simulated duration at concurrency 64 (from the in-process sweep)
    baseline = _held_closed_loop(sim_group, "baseline", 64, 21.0)
    eagle = _held_closed_loop(sim_group, "eagle", 64, 38.0)
    print(f"http sweep c=64: baseline {baseline:.1f} tok/s, eagle {eagle:.1f} tok/s")
    assert baseline == pytest.approx(773, rel=0.10)
    assert eagle == pytest.approx(354, rel=0.10)
