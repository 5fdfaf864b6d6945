"""Cost probes end to end: a simulated H200 group (profile h200-llama3-8b) behind a
`specrouter serve` without calibration. Before any client request the router has
measured both pools' decode step (proxy/shadow.py `CostProber`), so the first decision
already prices the baseline from a reading of it and not from EAGLE-3's through fixed
ratios (which put the baseline's step ~25% too low on H200); a client request arriving
during a probe cancels it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from loadtest import loopback
from specrouter.sim import physics
from specrouter.sim.profile import load_profile
from tests.fixtures.probes import CountedGroup
from tests.fixtures.router import RouterFactory, group_backends
from tests.fixtures.sim import SimGroup

PROFILE = "h200-llama3-8b"
PROMPT, TOKENS = 512, 64


def _learned(url: str) -> dict[str, Any]:
    group: dict[str, Any] = loopback.get(f"{url}/policy", timeout=5.0).json()["groups"][0]
    learned: dict[str, Any] = group["learned"]
    return learned


def _until(url: str, ok: Any, what: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        learned = _learned(url)
        if ok(learned):
            return learned
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; learned: {learned}")
        time.sleep(0.05)


def test_both_pools_are_measured_before_the_first_request(sim_group: Any,
                                                          router: RouterFactory) -> None:
    sim: SimGroup = sim_group(profile=PROFILE, time_scale=1.0)
    proc = router(group_backends(sim.eagle_url, sim.baseline_url), env={
        "SPECROUTER_COST_PROBE": json.dumps({"prompt_tokens": PROMPT, "tokens": TOKENS,
                                             "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})})
    learned = _until(proc.url, lambda m: m["pools"]["baseline"]["probes"]
                     and m["pools"]["eagle"]["probes"] == 2, "the probe readings of both pools")
    assert learned["probes"] == {"baseline/read": 1, "eagle/read": 2}, learned
    metrics = loopback.get(f"{proc.url}/metrics", timeout=5.0).text
    assert ('specrouter_cost_probes_total{group="gpu0",outcome="read",pool="baseline"} 1.0'
            in metrics), metrics
    profile = load_profile(PROFILE)
    ctx = PROMPT + TOKENS / 2
    true_base = physics.decode_step_ms(profile, 1, ctx)
    base = learned["pools"]["baseline"]["step_ms_at"]["1"]
    # the reading is the simulator's step within a few per cent (the transfer's guess
    # from EAGLE-3's step would be ~25% lower on this profile)
    assert abs(base - true_base) < 0.08 * true_base, (base, true_base)
    eagle = learned["pools"]["eagle"]["step_ms_at"]["1"]
    assert eagle / base > 1.2, learned  # an EAGLE-3 step costs more than a baseline one


def test_a_client_request_cancels_a_probe(sim_group: Any, router: RouterFactory) -> None:
    sim: SimGroup = sim_group(profile=PROFILE, time_scale=1.0)
    # long probes (1024 tokens: ~5 s on this profile) in the background only, which a
    # request is sure to meet
    proc = router(group_backends(sim.eagle_url, sim.baseline_url), env={
        "SPECROUTER_COST_PROBE": json.dumps({"prompt_tokens": 16, "tokens": 1024,
                                             "check_s": 0.1, "startup_wait_s": 0}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})})
    deadline = time.monotonic() + 20.0
    while not any(b["inflight"] for b in proc.ready()["backends"]):
        assert time.monotonic() < deadline, "no probe started"
        time.sleep(0.02)
    answer = loopback.post(f"{proc.v1}/completions", json={
        "model": "default", "prompt": "hi", "max_tokens": 4}, timeout=30.0)
    assert answer.status_code == 200
    learned = _until(proc.url, lambda m: m["probes"].get("baseline/cancelled"),
                     "the probe to be cancelled")
    assert not learned["probes"].get("baseline/read"), learned


def test_an_unused_pool_is_probed_again_at_the_traffics_context(
        sim_group: Any, router: RouterFactory) -> None:
    """The baseline, read by its start-up probe at 512 tokens, is read again at the
    traffic's context once the traffic's prompts are twice as long: on this profile a
    baseline step at ~9k tokens costs ~10% more than at 512, which EAGLE-3's telemetry,
    read at the traffic's context, would otherwise be compared with."""
    profile_name = "seed-coding"
    sim: SimGroup = sim_group(profile=profile_name, time_scale=1.0)
    proc = router(group_backends(sim.eagle_url, sim.baseline_url), env={
        "SPECROUTER_COST_PROBE": json.dumps({"prompt_tokens": PROMPT, "tokens": TOKENS,
                                             "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1}),
        "SPECROUTER_POLICY": json.dumps({"mode": "eagle"})})  # the baseline stays unused
    first = _until(proc.url, lambda m: m["pools"]["baseline"]["probes"] == 1,
                   "the start-up probe of the baseline")
    assert first["pools"]["baseline"]["probe_context_tokens"] == PROMPT
    prompt = "x" * 36_000  # ~9,000 tokens at 4 characters a token
    for _ in range(3):
        answer = loopback.post(f"{proc.v1}/completions", json={
            "model": "default", "prompt": prompt, "max_tokens": 4}, timeout=30.0)
        assert answer.status_code == 200
    learned = _until(proc.url, lambda m: m["pools"]["baseline"]["probe_context_tokens"] > PROMPT,
                     "the baseline probed at the traffic's context")
    baseline = learned["pools"]["baseline"]
    assert 8_500 <= baseline["probe_context_tokens"] <= 9_500, baseline
    assert baseline["readings"] == 1, baseline  # the reading at 512 tokens was replaced
    profile = load_profile(profile_name)
    ctx = baseline["probe_context_tokens"] + TOKENS / 2
    at_context, at_512 = (physics.decode_step_ms(profile, 1, c) for c in (ctx, PROMPT))
    step = baseline["step_ms_at"]["1"]
    assert abs(step - at_context) < abs(step - at_512), (step, at_context, at_512)


def test_a_group_without_one_of_the_pools_starts_without_waiting_for_it(
        sim_group: Any, router: RouterFactory) -> None:
    # Nothing can read a pool the group has no server of: the start-up probe reads the
    # pool there is and the router serves, long before a start-up wait of 10 minutes
    # (the fixture gives it 30 s to answer /health).
    sim: SimGroup = sim_group(profile=PROFILE, time_scale=0.2)
    proc = router([{"name": "gpu0-eagle", "url": sim.eagle_url, "pool": "eagle",
                    "group": "gpu0"}], env={
        "SPECROUTER_COST_PROBE": json.dumps({"prompt_tokens": PROMPT, "tokens": TOKENS,
                                             "check_s": 0.1, "startup_wait_s": 600}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})})
    assert _learned(proc.url)["probes"] == {"eagle/read": 2}


def test_a_request_the_engine_reports_between_rounds_is_waited_out(
        counted_group: CountedGroup, router: RouterFactory) -> None:
    """Right after the baseline's warm-up, the EAGLE engine reports a request running that
    the router did not send (another client's short generation, as SGLang's `/health`
    one-token generation shows before 0.5.23): the probe waits it out and reads the pool
    with its one warm-up, instead of giving up and prefilling a second."""
    count, eagle = counted_group.count, counted_group.proxies["eagle"]
    other_client = threading.Thread(target=lambda: loopback.post(
        f"{counted_group.sim.eagle_url}/generate", timeout=30.0,
        json={"text": "hi", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}))

    async def after_warm_up(pool: str) -> None:
        if pool != "baseline" or count.total[pool] != 1:
            return
        reports = eagle.busy_reports
        other_client.start()
        deadline = time.monotonic() + 10.0
        while eagle.busy_reports == reports:  # until the router has polled it
            assert time.monotonic() < deadline, "the router never read the other request"
            await asyncio.sleep(0.005)

    counted_group.proxies["baseline"].after_probe = after_warm_up
    proc = router(counted_group.backends(), env={
        "SPECROUTER_COST_PROBE": json.dumps({
            "prompt_tokens": 16, "tokens": 32, "eagle_batches": [1], "baseline_batches": [1],
            "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})})
    learned = _learned(proc.url)  # start-up returned: its probes ran
    other_client.join(30.0)
    assert learned["probes"] == {"baseline/read": 1, "eagle/read": 1}, learned
    assert count.total == {"baseline": 3, "eagle": 3}, count
