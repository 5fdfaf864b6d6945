"""The default router learns each pool's step cost from telemetry windows and switches
on sustained load (monitor -> learning -> online strategy -> GET /policy)."""

from __future__ import annotations

import pytest

from specrouter.backends import Backend
from specrouter.config import (
    AdmissionSettings,
    AffinitySettings,
    HealthSettings,
    TelemetrySettings,
)
from specrouter.control.holder import LocalPolicyHolder
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import EngineSample
from specrouter.routing.affinity.keys import PrefixKeys
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.policy import Policy
from specrouter.routing.router import RequestInfo, Target

GROUP = [Backend("g0-e", "http://h:1", "eagle", "g0"),
         Backend("g0-b", "http://h:2", "baseline", "g0")]
CHAT = RequestInfo("/v1/chat/completions")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(affinity: AffinitySettings | None = None
         ) -> tuple[LoadAwareRouter, BackendMonitor, Clock]:
    clock = Clock()
    health = HealthChecker(GROUP, HealthSettings(enabled=False),
                           BreakerConfig(failure_threshold=2, cooldown_s=5.0,
                                         success_threshold=1), clock=clock)
    monitor = BackendMonitor(GROUP, health, TelemetrySettings(enabled=False, sustained_s=5.0),
                             clock=clock)
    router = LoadAwareRouter(monitor, LocalPolicyHolder(Policy()),
                             AdmissionSettings(arrival_window_ms=0), rng=None,
                             affinity=affinity)
    return router, monitor, clock


def test_eagle_windows_teach_the_router_and_sustained_load_moves_the_group() -> None:
    router, monitor, clock = make()
    monitor.view.publish_accept("g0-e", EngineSample(1, 0, clock.now, accept_length=2.0,
                                                     accept_window=(2.0,)))
    # seed-coding's EAGLE-3 steps (37.4, 46.1, 50.4 ms at batch 1, 2, 3; accept 2.0), one
    # window a second while the router holds 1, then 2, then 3 requests on it
    rate = 120.0
    for batch, step_ms, windows in ((1, 37.4, 8), (2, 46.1, 8), (3, 50.4, 12)):
        t = router.choose(CHAT)
        assert t.pool == "eagle" and t.reason.startswith("online_")
        router.acquire(t)
        for _ in range(windows):
            clock.now += 1.0
            rate = 1000.0 * batch * 2.0 / step_ms if rate != 1000.0 * batch * 2.0 / step_ms \
                else rate + 1e-6  # a new window even at an equal throughput
            monitor._publish_sample("g0-e", EngineSample(batch, 0, clock.now, max_running=48,
                                                          gen_throughput=rate))
    live = {g["group"]: g for g in router.live_view()["groups"]}["g0"]
    learned = live["learned"]["pools"]
    assert learned["eagle"]["readings"] >= 24 and learned["baseline"]["readings"] == 0
    assert learned["eagle"]["batch_range"] == [1.0, 3.0]
    # the learned EAGLE-3 line, and the baseline's through the transfer, put the
    # crossover near seed-coding's (1.7)
    assert live["learned"]["crossover"] < 2.5 < live["sustained_load"]
    # at a sustained 2.6 the baseline leads, but a switch now would drain the three
    # requests held on EAGLE-3 next to the baseline's: the group waits for an idle EAGLE-3
    assert router.choose(CHAT).reason == "online_drain_eagle"
    for _ in range(2):
        router.acquire(router.choose(CHAT))
    clock.now += 10.0  # five requests held: waiting for EAGLE-3 to idle costs more
    t = router.choose(CHAT)
    assert (t.pool, t.reason) == ("baseline", "online_baseline")


def test_a_target_carries_the_prompt_tokens_its_backend_has_not_cached() -> None:
    router, monitor, clock = make(AffinitySettings(block_bytes=512))
    prompt = PrefixKeys(tuple(range(8)), 128.0, 1000.0)  # 8 blocks of 128 tokens
    first = router.choose(RequestInfo("/v1/chat/completions", prefix=prompt))
    assert first.prefill_tokens == 1000.0
    router.acquire(first)
    # the same prompt again: the backend holds its 8 blocks, 1,000 tokens (the estimate)
    again = router.choose(RequestInfo("/v1/chat/completions", prefix=prompt))
    assert again.backend == first.backend and again.prefill_tokens == 0.0
    assert router.choose(CHAT).prefill_tokens == 0.0  # no prompt estimate: nothing
    # what the router sent is what the readings are taken net of
    assert monitor.learning._prefills[first.backend.name].tokens(0.0, clock.now) == 1000.0
    # and the whole prompt, cached or not, is the traffic's context a cost probe decodes at
    assert first.prompt_tokens == again.prompt_tokens == 1000.0
    router.acquire(again)
    router.acquire(router.choose(CHAT))  # no prompt estimate: not counted
    assert monitor.learning.traffic_context(first.group) == 1000.0


def test_the_routers_own_probes_count_in_flight_but_not_in_the_sustained_load() -> None:
    router, monitor, clock = make()
    eagle = GROUP[0]
    # a cost probe's batch of four on EAGLE-3 while no client sends anything
    probes = [Target("g0", "eagle", eagle, "cost_probe", own=True) for _ in range(4)]
    for probe in probes:
        router.acquire(probe)
    clock.now += 60.0
    assert router.inflight(eagle.name) == 4  # the group's load sees them
    assert monitor.learning.sustained("g0", clock.now) == 0.0  # the demand does not
    # a client's request next to them moves it, and only by itself
    client = router.choose(CHAT)
    router.acquire(client)
    clock.now += 60.0
    assert monitor.learning.sustained("g0", clock.now) == pytest.approx(1.0, rel=1e-3)
    for probe in probes:
        router.release(probe)
    clock.now += 60.0
    assert monitor.learning.sustained("g0", clock.now) == pytest.approx(1.0, rel=1e-3)
    router.release(client)
    clock.now += 300.0
    assert monitor.learning.sustained("g0", clock.now) == pytest.approx(0.0, abs=1e-3)
