"""Cost probes of two `specrouter serve` replicas starting together on one real
`redis-server`, in front of one simulated H200 group: the group's cluster-wide lock puts
one probe at a time on its GPUs, and one probe per pool serves both replicas (the one that
did not probe folds in the other's published reading).

The engines sit behind counting proxies (`tests/fixtures/probes.py`) that see every probe
generation: how many run at once on the group, and how many ran.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loadtest import loopback
from tests.fixtures.probes import CountedGroup
from tests.fixtures.procs import free_port, wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory, RouterProc


def _learned(proc: RouterProc) -> dict[str, Any]:
    group: dict[str, Any] = loopback.get(f"{proc.url}/policy", timeout=5.0).json()["groups"][0]
    learned: dict[str, Any] = group["learned"]
    return learned


def test_replicas_starting_together_probe_each_pool_once_one_at_a_time(
    redis_server: RedisServer, counted_group: CountedGroup,
    router: RouterFactory,
) -> None:
    count, backends = counted_group.count, counted_group.backends()
    env = {
        "SPECROUTER_REDIS_URL": redis_server.url(),
        "SPECROUTER_STATE": json.dumps({"key_prefix": "probelock"}),
        # one generation a probe round, ~1.8 s long at this profile's 7 ms step: two
        # replicas starting together would overlap without the lock
        "SPECROUTER_COST_PROBE": json.dumps({
            "prompt_tokens": 16, "tokens": 256, "eagle_batches": [1],
            "baseline_batches": [1], "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1}),
    }
    with ThreadPoolExecutor(2) as pool:  # each returns once its start-up probes are done
        replicas = list(pool.map(lambda _: router(backends, env=env), range(2)))
    models = [_learned(r) for r in replicas]
    assert count.peak == 1, (count, models)
    # one probe a pool (a warm-up, a short and a long generation) served both replicas
    assert count.total == {"baseline": 3, "eagle": 3}, (count, models)
    for p in ("baseline", "eagle"):
        outcomes = sorted((m["probes"].get(f"{p}/read", 0), m["probes"].get(f"{p}/shared", 0))
                          for m in models)
        assert outcomes == [(0, 1), (1, 0)], models  # read by one, shared with the other
    assert all(m["pools"][p]["readings"] >= 1 for m in models for p in ("baseline", "eagle"))


def test_with_redis_unreachable_a_replica_still_probes_on_its_own(
    counted_group: CountedGroup, router: RouterFactory,
) -> None:
    count, backends = counted_group.count, counted_group.backends()
    proc = router(backends, env={
        "SPECROUTER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens
        "SPECROUTER_COST_PROBE": json.dumps({
            "prompt_tokens": 16, "tokens": 32, "eagle_batches": [1], "baseline_batches": [1],
            "check_s": 0.1}),
        "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})})
    learned = _learned(proc)  # start-up returned: its probes ran, none hung
    assert learned["probes"] == {"baseline/read": 1, "eagle/read": 1}, learned
    assert count.total == {"baseline": 3, "eagle": 3}
    assert proc.ready()["state"]["degraded"]


def test_the_lock_of_a_replica_killed_mid_probe_expires_and_another_probes(
    redis_server: RedisServer, counted_group: CountedGroup,
    router: RouterFactory,
) -> None:
    count, backends = counted_group.count, counted_group.backends()

    def env(tokens: int, timeout_s: float) -> dict[str, str]:
        return {
            "SPECROUTER_REDIS_URL": redis_server.url(),
            "SPECROUTER_STATE": json.dumps({"key_prefix": "probelock"}),
            "SPECROUTER_COST_PROBE": json.dumps({
                "prompt_tokens": 16, "tokens": tokens, "eagle_batches": [1],
                "baseline_batches": [1], "check_s": 0.1, "startup_wait_s": 0,
                "timeout_s": timeout_s}),
            "SPECROUTER_HEALTH": json.dumps({"interval_s": 0.1})}

    # the victim's long round runs ~3.6 s; its lock lives 2 + 4 s
    victim = router(backends, env=env(512, 2.0))
    # the warm-up, the short round, then the long one
    wait_until(lambda: count.total.get("baseline", 0) >= 3, 20.0, "the victim's long round")
    survivor = router(backends, env=env(32, 30.0))
    key, client = "probelock:lock:cost-probe:gpu0", redis_server.client()
    token, ttl_ms = client.get(key), client.pttl(key)
    assert token is not None and 0 < ttl_ms <= 6000, (token, ttl_ms)
    victim.process.signal(9)
    wait_until(lambda: client.get(key) != token, 6.5, "the dead holder's lock to expire")
    # the survivor had not probed while the dead replica's lock lived
    assert not _learned(survivor)["probes"].get("baseline/read")
    wait_until(lambda: {"baseline/read", "eagle/read"} <= set(_learned(survivor)["probes"]),
               20.0, "the survivor's own probes")
    assert count.peak == 1, count
