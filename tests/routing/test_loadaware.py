"""LoadAwareRouter in process: the request-path logic with telemetry and health checks off
(their loops are covered end to end in tests/integration)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from specrouter.backends import Backend
from specrouter.config import AdmissionSettings, HealthSettings, TelemetrySettings
from specrouter.control.holder import LocalPolicyHolder
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import EngineSample
from specrouter.routing import loadaware
from specrouter.routing.loadaware import InvalidPoolHeader, LoadAwareRouter
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.policy import Policy
from specrouter.routing.router import NoBackendAvailable, RequestInfo, Target

ONE_GROUP = [Backend("g0-e", "http://h:1", "eagle", "g0"),
             Backend("g0-b", "http://h:2", "baseline", "g0")]
TWO_GROUPS = [*ONE_GROUP, Backend("g1-e", "http://h:3", "eagle", "g1"),
              Backend("g1-b", "http://h:4", "baseline", "g1")]
CHAT = RequestInfo("/v1/chat/completions")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(backends: list[Backend], window_s: float = 0.0, max_wait_s: float = 0.016,
         recall: bool = False, memory_s: float = 60.0,
         **policy: object) -> tuple[LoadAwareRouter, Clock]:
    clock = Clock()
    health = HealthChecker(backends, HealthSettings(enabled=False),
                           BreakerConfig(failure_threshold=2, cooldown_s=5.0,
                                         success_threshold=1), clock=clock)
    monitor = BackendMonitor(backends, health, TelemetrySettings(enabled=False), clock=clock)
    holder = LocalPolicyHolder(Policy.model_validate({"strategy": "threshold", **policy}))
    admission = AdmissionSettings(arrival_window_ms=window_s * 1000,
                                  arrival_max_wait_ms=max_wait_s * 1000, recall_unstarted=recall,
                                  arrival_memory_s=memory_s)
    return LoadAwareRouter(monitor, holder, admission), clock


def admit(router: LoadAwareRouter, request: RequestInfo = CHAT) -> Target:
    target = router.choose(request)
    router.acquire(target)
    return target


def test_burst_arriving_together_goes_to_the_baseline_whole() -> None:
    async def burst(router: LoadAwareRouter, n: int) -> list[str]:
        async def one() -> str:
            await router.settle(CHAT)
            return admit(router).pool

        return list(await asyncio.gather(*(one() for _ in range(n))))

    alone, _ = make(ONE_GROUP, window_s=0.0, switch_up=0.5, switch_down=0)
    assert asyncio.run(burst(alone, 3)) == ["eagle", "baseline", "baseline"]
    windowed, _ = make(ONE_GROUP, window_s=0.01, switch_up=0.5, switch_down=0)
    assert asyncio.run(burst(windowed, 3)) == ["baseline", "baseline", "baseline"]
    # A request on its own still gets EAGLE-3 (once the burst is gone).
    single, _ = make(ONE_GROUP, window_s=0.01, switch_up=0.5, switch_down=0)
    assert asyncio.run(burst(single, 1)) == ["eagle"]


def test_nothing_waits_in_the_baseline_regime_or_in_forced_modes() -> None:
    async def timed(router: LoadAwareRouter) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await router.settle(CHAT)
        return loop.time() - started

    busy, _ = make(ONE_GROUP, window_s=0.5, switch_up=2, switch_down=1)
    for _ in range(3):
        admit(busy)
    assert asyncio.run(timed(busy)) < 0.25
    forced, _ = make(ONE_GROUP, window_s=0.5, mode="eagle")
    assert asyncio.run(timed(forced)) < 0.25
    # No baseline server to send a burst to: every request goes to EAGLE-3 anyway.
    eagle_only, _ = make(ONE_GROUP[:1], window_s=0.5, switch_up=2, switch_down=1)
    assert asyncio.run(timed(eagle_only)) < 0.25
    idle, _ = make(ONE_GROUP, window_s=0.5, switch_up=2, switch_down=1)
    assert asyncio.run(timed(idle)) >= 0.5  # the EAGLE-bound case does wait


async def _settle_times(router: LoadAwareRouter, gaps: list[float]) -> list[float]:
    """Requests one after another (each released before the next): how long each one's
    `settle` took, after the given pause."""
    loop = asyncio.get_running_loop()
    waits = []
    for gap in gaps:
        await asyncio.sleep(gap)
        started = loop.time()
        burst_ahead = await router.settle(CHAT)
        waits.append(loop.time() - started)
        router.release(admit(router, replace(CHAT, burst_ahead=burst_ahead)))
    return waits


def test_no_wait_when_no_burst_seen_lately_could_flip_the_decision() -> None:
    # Requests 0.3 s apart, one at a time: a burst seen is one request, plausibly two.
    # Far below switch_up 8 two more cannot flip EAGLE-3: nothing waits the 0.15 s
    # window, from the router's first request on (before one memory period of 0.2 s).
    far, _ = make(ONE_GROUP, window_s=0.15, max_wait_s=0.15, memory_s=0.2,
                  switch_up=8, switch_down=4)
    assert max(asyncio.run(_settle_times(far, [0.0, 0.3, 0.3]))) < 0.1


def test_a_burst_on_a_young_router_is_decided_together_once_it_is_plausible() -> None:
    async def burst(router: LoadAwareRouter, n: int) -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()

        async def one() -> tuple[str, float]:
            started = loop.time()
            ahead = await router.settle(CHAT)
            return admit(router, replace(CHAT, burst_ahead=ahead)).pool, loop.time() - started

        return list(await asyncio.gather(*(one() for _ in range(n))))

    # The first request alone cannot flip switch_up 4 with a plausible two more: it goes
    # at once. From the second on, a burst of four more is plausible: they wait and are
    # decided together.
    young, _ = make(ONE_GROUP, window_s=0.05, max_wait_s=0.05, switch_up=4, switch_down=0)
    decided = asyncio.run(burst(young, 6))
    assert decided[0][0] == "eagle" and decided[0][1] < 0.04
    assert [pool for pool, _ in decided[1:]] == ["baseline"] * 5
    assert decided[1][1] >= 0.05  # the last ones saw a load bound for the baseline anyway


def test_the_window_still_waits_where_a_plausible_burst_flips_the_decision() -> None:
    # Near the switch point: two more requests would reach switch_up 1.5.
    near, _ = make(ONE_GROUP, window_s=0.15, max_wait_s=0.15, memory_s=0.2,
                   switch_up=1.5, switch_down=0)
    assert min(asyncio.run(_settle_times(near, [0.0, 0.3, 0.3]))) >= 0.15

    # Far below switch_up 8, but a burst of five was seen within the memory: it waits.
    async def after_a_burst(router: LoadAwareRouter) -> list[float]:
        await _settle_times(router, [0.0, 0.3])  # watched for one period
        await asyncio.gather(*(router.settle(CHAT) for _ in range(5)))
        return await _settle_times(router, [0.01])

    seen, _ = make(ONE_GROUP, window_s=0.15, max_wait_s=0.15, memory_s=0.2,
                   switch_up=8, switch_down=4)
    assert asyncio.run(after_a_burst(seen))[0] >= 0.15


def test_credit_rule_and_stale_telemetry() -> None:
    router, clock = make(TWO_GROUPS, switch_up=4, switch_down=1)
    # Other clients keep g0 busy: the engine says 5 running, the router sent none.
    router.monitor.view.publish("g0-e", EngineSample(running=5, waiting=0, received_at=clock.now))
    first = admit(router)
    assert first.group == "g1" and first.pool == "eagle"
    # Three poll intervals later that sample is ignored: g0 looks idle again.
    clock.now += 0.31
    second = admit(router)
    assert second.group == "g0" and second.reason == "below_switch_down"
    assert router.live_metrics().backends[0].stale_reads >= 1


def test_retry_excludes_the_failed_backend_and_route_pools() -> None:
    router, _ = make(ONE_GROUP)
    retry = router.choose(RequestInfo("/v1/chat/completions", exclude=frozenset({"g0-e"})))
    assert (retry.backend.name, retry.reason) == ("g0-b", "eagle_unhealthy")
    assert router.choose(RequestInfo("/v1/files", pool="baseline")).reason == "route_pool"
    fallback = router.choose(RequestInfo("/v1/files", pool="baseline",
                                         exclude=frozenset({"g0-b"})))
    assert (fallback.backend.name, fallback.reason) == ("g0-e", "route_pool_unavailable")
    with pytest.raises(NoBackendAvailable):
        router.choose(RequestInfo("/v1/chat/completions", exclude=frozenset({"g0-e", "g0-b"})))


def test_breaker_takes_a_backend_out_and_a_probe_brings_it_back() -> None:
    router, clock = make(ONE_GROUP)
    for _ in range(2):
        router.record_outcome("g0-e", False, "HTTP 503")
    assert not router.healthy("g0-e")
    assert admit(router).reason == "eagle_unhealthy"
    clock.now += 5.0  # cool-down over: half-open, one probe
    probe = router.choose(CHAT)
    assert probe.backend.name == "g0-e"
    assert not router.healthy("g0-e")  # the probe slot is taken
    router.record_outcome("g0-e", True)
    assert router.healthy("g0-e") and router.details()["backends"][0]["breaker"] == "closed"


def test_a_trial_request_that_ends_without_an_outcome_frees_the_slot_as_it_leaves() -> None:
    """A half-open backend's trial whose client left before the engine answered (no
    outcome) gives the slot back at its release, not after the trial's 30 s timeout."""
    router, clock = make(ONE_GROUP)
    for _ in range(2):
        router.record_outcome("g0-e", False, "HTTP 503")
    clock.now += 5.0
    trial = admit(router)
    assert trial.backend.name == "g0-e" and trial.trial == clock.now
    assert not router.healthy("g0-e")
    clock.now += 0.1
    router.release(trial)
    assert router.healthy("g0-e")
    # the next trial gets the slot; a request that took none carries no claim
    assert admit(router).backend.name == "g0-e" and admit(router).trial is None


def test_client_header_rules() -> None:
    allowed, _ = make(ONE_GROUP, allow_client_override=True)
    assert allowed.choose(RequestInfo("/v1/chat/completions",
                                      pool_header="baseline")).reason == "client_override"
    with pytest.raises(InvalidPoolHeader):
        allowed.choose(RequestInfo("/v1/chat/completions", pool_header="both"))
    denied, _ = make(ONE_GROUP)
    assert denied.choose(RequestInfo("/v1/chat/completions", pool_header="both")).pool == "eagle"


async def _spread(router: LoadAwareRouter, n: int, gap_s: float,
                  use_hint: bool = True) -> list[str]:
    """`n` requests `gap_s` apart through settle and choose, as the proxy runs them."""
    return [t.pool for t in await _spread_targets(router, n, gap_s, use_hint)]


async def _spread_targets(router: LoadAwareRouter, n: int, gap_s: float,
                          use_hint: bool = True) -> list[Target]:
    async def one(i: int) -> Target:
        await asyncio.sleep(i * gap_s)  # each client connects a little later
        burst_ahead = await router.settle(CHAT)
        return admit(router, replace(CHAT, burst_ahead=burst_ahead if use_hint else 0))

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_burst_spread_over_several_windows_is_still_seen_whole() -> None:
    router, _ = make(ONE_GROUP, window_s=0.02, switch_up=0.5, switch_down=0)
    # 6 arrivals 10 ms apart: 50 ms in all, more than two windows, fewer than the cap.
    assert asyncio.run(_spread(router, 6, 0.01)) == ["baseline"] * 6


def test_a_burst_still_arriving_at_the_cap_is_expected_to_go_on() -> None:
    # 60 requests 5 ms apart (closed-loop clients opening their connections), as the
    # router saw them once already (so a burst that size is plausible): the first one's
    # wait ends at the 100 ms cap with ~20 seen, below switch_up 30. Taken to go on as long
    # again, the burst is ~40: nothing goes to EAGLE-3. The gaps are wide enough that a
    # loaded host's millisecond scheduling delays do not thin the burst the cap sees.
    def run(use_hint: bool) -> list[str]:
        router, _ = make(ONE_GROUP, window_s=0.025, max_wait_s=0.1, switch_up=30,
                         switch_down=20)

        async def again() -> list[str]:
            for target in await _spread_targets(router, 60, 0.005):
                router.release(target)
            return await _spread(router, 60, 0.005, use_hint)

        return asyncio.run(again())

    assert run(use_hint=True) == ["baseline"] * 60
    assert "eagle" in run(use_hint=False)  # what the cap alone would do


STREAM = replace(CHAT, stream=True)


def _recalled(targets: list[Target]) -> list[bool]:
    return [t.recall is not None and t.recall.is_set() for t in targets]


def test_switch_to_the_baseline_recalls_the_groups_unstarted_eagle_streams() -> None:
    router, _ = make(ONE_GROUP, recall=True, switch_up=3, switch_down=0,
                     load_signal="inflight")
    eagles = [admit(router, STREAM) for _ in range(3)]
    assert [t.pool for t in eagles] == ["eagle"] * 3
    router.release(eagles[0])  # finished before the switch: nothing to recall
    assert _recalled(eagles) == [False] * 3
    router.acquire(replace(eagles[0], recall=None))  # load back to 3
    switching = admit(router, STREAM)
    assert (switching.pool, switching.reason) == ("baseline", "above_switch_up")
    assert _recalled(eagles) == [False, True, True]
    # the switching stream may itself leave the baseline at the next switch back
    assert switching.recall is not None and not switching.recall.is_set()
    # A recalled request's new target is final, even if EAGLE-3 is chosen again.
    for t in eagles[1:]:
        router.release(t)
    again = router.choose(replace(STREAM, recalled=True))
    assert again.recall is None


def test_switch_back_to_eagle_recalls_the_groups_baseline_streams() -> None:
    router, _ = make(ONE_GROUP, recall=True, switch_up=3, switch_down=1,
                     load_signal="inflight")
    eagles = [admit(router, STREAM) for _ in range(3)]
    baselines = [admit(router, STREAM) for _ in range(2)]  # loads 3 and 4
    assert [t.pool for t in baselines] == ["baseline"] * 2
    for t in [*eagles, baselines[0]]:
        router.release(t)
    assert _recalled(baselines) == [False, False]
    back = admit(router, STREAM)  # load 1: the group goes back to EAGLE-3
    assert (back.pool, back.reason) == ("eagle", "below_switch_down")
    assert _recalled(baselines) == [False, True]  # the one still in flight
    assert _recalled([back]) == [False]


def test_a_continuation_follows_its_group_and_never_switches_it() -> None:
    # The handed-over stream's first attempt is still counted (until its abort is
    # acknowledged): decided as a new arrival at load 2 it would switch the group back.
    router, _ = make(ONE_GROUP, recall=True, switch_up=2, switch_down=1,
                     load_signal="inflight")
    first, second = admit(router, STREAM), admit(router, STREAM)
    assert (first.pool, second.pool) == ("eagle", "eagle")
    continued = router.choose(replace(STREAM, recalled=True, handed_over=True))
    assert (continued.pool, continued.reason) == ("eagle", "handover_follows_group")
    assert _recalled([first, second]) == [False, False]
    assert admit(router, STREAM).reason == "above_switch_up"  # a new arrival does switch


def test_a_group_with_one_pool_gives_no_recall_event() -> None:
    for backends in (ONE_GROUP[:1], ONE_GROUP[1:]):
        router, _ = make(backends, recall=True, switch_up=3, switch_down=1)
        assert admit(router, STREAM).recall is None  # nowhere to recall it to


def test_no_recall_for_non_streams_overrides_overflow_or_when_off() -> None:
    on, _ = make(ONE_GROUP, recall=True, switch_up=2, switch_down=0, load_signal="inflight",
                 allow_client_override=True)
    assert admit(on, CHAT).recall is None  # a non-streamed answer arrives whole
    asked = admit(on, replace(STREAM, pool_header="eagle"))
    assert (asked.pool, asked.reason, asked.recall) == ("eagle", "client_override", None)
    off, _ = make(ONE_GROUP, recall=False, switch_up=2, switch_down=0)
    assert admit(off, STREAM).recall is None
    overflow, _ = make(ONE_GROUP, recall=True, strategy="overflow", eagle_cap=1,
                       load_signal="inflight")
    assert admit(overflow, STREAM).recall is None


def test_a_request_the_window_lets_through_is_decided_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`choose` takes the window's dry run for the request `settle` let through at once,
    and decides anew wherever anything changed since, or time passed."""
    calls: list[str] = []
    real = loadaware.decide

    def counted(*args: Any, **kwargs: Any) -> Any:
        decision = real(*args, **kwargs)
        calls.append(decision.reason)
        return decision

    monkeypatch.setattr(loadaware, "decide", counted)
    busy, clock = make(ONE_GROUP, window_s=0.5, switch_up=2, switch_down=1,
                       allow_client_override=True)
    for _ in range(3):
        admit(busy)  # the baseline regime: the window never waits
    calls.clear()

    async def settle_then_choose(between: Callable[[], None] = lambda: None) -> Target:
        await busy.settle(CHAT)
        between()
        return busy.choose(CHAT)

    target = asyncio.run(settle_then_choose())
    assert (target.pool, target.reason) == ("baseline", "above_switch_up")
    assert calls == ["above_switch_up"]  # the dry run's decision, taken by `choose`
    assert busy.choose(CHAT).reason == target.reason and len(calls) == 2  # decided anew
    for change in (lambda: busy.acquire(target),  # a count changed the views
                   lambda: setattr(clock, "now", clock.now + 0.01)):  # time passed
        calls.clear()
        asyncio.run(settle_then_choose(change))
        assert len(calls) == 2
    calls.clear()
    # a client's pool header is a hint the dry run did not have
    pinned = asyncio.run(settle_then_choose_with(busy, replace(CHAT, pool_header="eagle")))
    assert len(calls) == 2 and pinned.reason == "client_override"


async def settle_then_choose_with(router: LoadAwareRouter, request: RequestInfo) -> Target:
    await router.settle(CHAT)
    return router.choose(request)
