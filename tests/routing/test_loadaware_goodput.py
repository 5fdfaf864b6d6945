"""The goodput strategy inside LoadAwareRouter: the EAGLE server's accept-length readings
(published by the telemetry poller) move the group's average at the poll rate, whatever
the request rate, and an idle EAGLE server is probed to re-measure it. The poller itself
is not started: its publish callbacks are called with the samples it would deliver."""

from __future__ import annotations

import asyncio

import pytest

from specrouter.backends import Backend
from specrouter.config import AdmissionSettings, HealthSettings, TelemetrySettings
from specrouter.control.holder import LocalPolicyHolder
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import EngineSample
from specrouter.observe.telemetry import parse_metrics, parse_v1_loads
from specrouter.routing.costsource import profile_model
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.policy import Policy
from specrouter.routing.router import RequestInfo, Target
from tests.observe.test_telemetry_parsers import sglang_metrics_text

EAGLE, BASE = "g0-e", "g0-b"
GROUP = [Backend(EAGLE, "http://h:1", "eagle", "g0"), Backend(BASE, "http://h:2", "baseline", "g0")]
CHAT = RequestInfo("/v1/chat/completions")
# h200-llama3-8b (chain 3/1/4, EAGLE cap 48): crossover 61.6 at accept 3.0, 12.4 at 1.6.
LOAD = 28


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(window_s: float = 0.0, **policy: object) -> tuple[LoadAwareRouter, Clock]:
    clock = Clock()
    health = HealthChecker(GROUP, HealthSettings(enabled=False), BreakerConfig(), clock=clock)
    monitor = BackendMonitor(GROUP, health, TelemetrySettings(interval_s=0.1), clock=clock)
    holder = LocalPolicyHolder(Policy.model_validate({"strategy": "goodput", **policy}))
    admission = AdmissionSettings(arrival_window_ms=window_s * 1000, recall_unstarted=False)
    router = LoadAwareRouter(monitor, holder, admission,
                             cost_models={"g0": profile_model("h200-llama3-8b", 2048)})
    return router, clock


def poll(router: LoadAwareRouter, clock: Clock, eagle_running: int, base_running: int,
         accept: float) -> None:
    """One telemetry round as the poller delivers it (/v1/loads carries the accept)."""
    assert router.monitor.poller is not None
    clock.now += 0.1
    router.monitor.poller.publish(EAGLE, EngineSample(eagle_running, 0, clock.now, accept))
    router.monitor.poller.publish(BASE, EngineSample(base_running, 0, clock.now))


def group_view(router: LoadAwareRouter) -> dict[str, object]:
    group: dict[str, object] = router.live_view()["groups"][0]
    return group


def admit(router: LoadAwareRouter) -> Target:
    target = router.choose(CHAT)
    router.acquire(target)
    return target


def test_accept_readings_between_requests_each_count() -> None:
    router, clock = make()
    poll(router, clock, LOAD, 0, 3.0)
    first = admit(router)
    assert (first.pool, first.reason) == ("eagle", "goodput_eagle")
    router.release(first)
    # The workload shifts; ten polls arrive and no request is decided meanwhile.
    for _ in range(10):
        poll(router, clock, LOAD, 0, 1.6)
    accept = router.group_states()["g0"].accept.ewma
    assert accept is not None and accept < 1.65  # 1.6 + 1.4 * 0.7**10 = 1.64
    view = group_view(router)
    assert (view["choice"], view["reason"]) == ("baseline", "goodput_baseline")
    second = admit(router)
    assert (second.pool, second.reason) == ("baseline", "goodput_baseline")


def test_idle_eagle_server_is_probed_when_due() -> None:
    router, clock = make(goodput_probe_s=5.0)
    for accept in [3.0] * 10 + [1.6] * 10:  # the workload accepted 3.0, then 1.6
        poll(router, clock, LOAD, 0, accept)
    assert admit(router).pool == "baseline"  # switches at t0; dwell from here
    switched = clock.now
    # Not yet due: the readings since the switch are recent enough.
    poll(router, clock, 0, LOAD, 1.6)
    assert admit(router).reason == "goodput_baseline"
    while clock.now < switched + 5.0:
        poll(router, clock, 0, LOAD, 1.6)
    routed = admit(router)
    # The client's request keeps the baseline; a shadow copy probes the EAGLE server.
    assert (routed.pool, routed.reason) == ("baseline", "goodput_baseline")
    assert routed.probe is not None and routed.probe.target.backend.name == EAGLE
    assert routed.probe.max_tokens == 128  # the default goodput_probe_tokens
    probe = routed.probe.target
    router.acquire(probe)  # the proxy counts the probe in flight while it runs
    # One probe at a time: while it runs the EAGLE server's readings are live.
    assert admit(router).probe is None
    # The probe finds the workload accepting more again: back to EAGLE-3.
    for _ in range(15):
        poll(router, clock, 1, LOAD, 3.0)
    router.release(probe)
    clock.now += 1.0
    back = admit(router)
    assert (back.pool, back.reason) == ("eagle", "goodput_eagle")


def test_no_probe_when_probes_are_off() -> None:
    router, clock = make(goodput_probe_s=0)
    for accept in [3.0] * 10 + [1.6] * 10:  # a probe would be due: 3.0 before
        poll(router, clock, LOAD, 0, accept)
    assert admit(router).pool == "baseline"
    for _ in range(100):
        poll(router, clock, 0, LOAD, 1.6)
        target = admit(router)
        assert target.pool == "baseline" and target.probe is None


def test_a_steady_accept_length_is_never_probed() -> None:
    # The sweep's case: the workload accepts 1.6 all along, the group is on the baseline
    # because of its load (17: crossover 12.4 at 1.6), and readings of a request or two
    # scatter (a run of highs, then of lows). The fast average peaks near 1.9 (crossover
    # 22: EAGLE-3 would win at 17); the slow trend's peak stays near 1.7 (crossover 16:
    # it would not), so no probe slows the shared GPU for noise.
    router, clock = make()
    for accept in [1.6] * 10 + [2.1] * 3 + [1.1] * 3 + [1.6] * 5:
        poll(router, clock, 4, 13, accept)  # readings of 4 requests: the plain weights
    for _ in range(100):
        poll(router, clock, 0, 17, 1.6)
        target = router.choose(CHAT)
        assert target.pool == "baseline" and target.probe is None
    peak = router.group_states()["g0"].accept.peak
    assert peak is not None
    crossover = profile_model("h200-llama3-8b", 2048).crossover(peak)
    assert crossover is not None and crossover < 17 + 1


def test_no_probe_when_even_the_peak_would_not_clear_the_switching_margin() -> None:
    # The trend peaked at 1.75 (crossover 17): at 15 requests EAGLE-3 would lead by only
    # 1.9% back there, less than the 3% goodput_margin a switch needs, so a probe could
    # not change the decision and would only slow the shared GPU.
    router, clock = make(goodput_probe_s=0.5)
    for accept in [1.75] * 30 + [1.6] * 20:
        poll(router, clock, 4, 11, accept)
    assert router.choose(CHAT).pool == "baseline"
    for _ in range(50):
        poll(router, clock, 0, 15, 1.6)
        target = router.choose(CHAT)
        assert target.pool == "baseline" and target.probe is None
    peak = router.group_states()["g0"].accept.peak
    model = profile_model("h200-llama3-8b", 2048)
    assert peak is not None and 1.0 < model.ratio(16, peak) < 1.03


def test_a_quiet_group_that_moved_to_the_baseline_is_probed_back() -> None:
    # One request at a time, accepting 3.0, then a long run of low readings drags the
    # average below the crossover at load 1 and the group to the baseline, where the
    # EAGLE server gets no more readings. The trend's peak still remembers ~3: a probe
    # goes out once due, or the group would stay on the baseline for good.
    router, clock = make(goodput_probe_s=1.0)
    for accept in [3.0] * 20 + [1.0] * 40:
        poll(router, clock, 1, 0, accept)
    target = admit(router)
    assert target.pool == "baseline" and target.probe is None
    router.release(target)
    for _ in range(12):
        poll(router, clock, 0, 0, 1.0)
        target = router.choose(CHAT)
        if target.probe is not None:
            break
    assert target.pool == "baseline" and target.probe is not None


def test_no_probe_where_even_the_old_accept_length_loses() -> None:
    # At 3.0 the crossover is 61.6: with 70 requests in the group the baseline is ahead
    # even if the accept length came back, so a probe would be wasted.
    router, clock = make(goodput_probe_s=0.5)
    for _ in range(10):
        poll(router, clock, 20, 0, 3.0)
    for _ in range(100):
        poll(router, clock, 0, 70, 1.6)
        target = router.choose(CHAT)
        assert target.pool == "baseline" and target.probe is None


def test_a_reading_counts_by_the_requests_behind_it() -> None:
    # One request's reading scatters ~4x as much as one of sixteen: it moves the
    # average less, so a few unlucky steps of a lone request cannot flip a quiet group.
    def weight_of(batch: int) -> float:
        router, clock = make(goodput_probe_s=0)  # no probes: the average never goes stale
        poll(router, clock, 4, 0, 3.0)
        before = router.group_states()["g0"].accept.ewma
        poll(router, clock, batch, 0, 2.0)
        after = router.group_states()["g0"].accept.ewma
        assert before is not None and after is not None
        return (before - after) / (before - 2.0)

    assert weight_of(1) == pytest.approx(1 - 0.7 ** 0.25)  # a quarter of a reading
    assert weight_of(4) == pytest.approx(0.3)  # the reference batch: the plain weight
    assert weight_of(16) == pytest.approx(1 - 0.7 ** 4)
    assert weight_of(64) == pytest.approx(1 - 0.7 ** 4)  # capped
    assert weight_of(0) == weight_of(1)  # an idle server's last steps: one request's
    # ... once: it repeats that snapshot at every poll until the server works again.
    router, clock = make(goodput_probe_s=0)
    poll(router, clock, 4, 0, 3.0)
    poll(router, clock, 0, 0, 2.0)
    once = router.group_states()["g0"].accept.ewma
    for _ in range(20):
        poll(router, clock, 0, 0, 2.0)
    assert router.group_states()["g0"].accept.ewma == once
    poll(router, clock, 1, 0, 2.0)  # busy again: its readings count
    again = router.group_states()["g0"].accept.ewma
    assert once is not None and again is not None and again < once


def poll_gauge(router: LoadAwareRouter, clock: Clock, running: int, accept: float) -> None:
    """One telemetry round of the EAGLE server as SGLang answers it: the load from
    /v1/loads (whose accept length is the lifetime mean, unused), the windowed accept
    length from the /metrics gauge, which changes only when 40 new decode batches are in."""
    poller = router.monitor.poller
    assert poller is not None and poller.publish_accept is not None
    clock.now += 0.1
    poller.publish(EAGLE, parse_v1_loads({"loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
        "speculative": {"accept_length": 2.4, "accept_rate": 0.5}}]}, clock.now))
    poller.publish_accept(EAGLE, parse_metrics(
        sglang_metrics_text([running], [0], accept), clock.now))


def poll_base(router: LoadAwareRouter, clock: Clock, running: int) -> None:
    """The baseline server's half of the same telemetry round (no accept length)."""
    assert router.monitor.poller is not None
    router.monitor.poller.publish(BASE, EngineSample(running, 0, clock.now))


def test_an_engine_window_counts_once_and_the_lifetime_mean_never() -> None:
    # SGLang refreshes its accept gauge every 40 decode batches; the router polls faster.
    router, clock = make(goodput_probe_s=0)
    poll_gauge(router, clock, 4, 3.0)
    before = router.group_states()["g0"].accept.ewma
    poll_gauge(router, clock, 4, 2.0)
    after = router.group_states()["g0"].accept.ewma
    assert before is not None and after is not None
    assert (before - after) / (before - 2.0) == pytest.approx(0.3)  # a whole new window
    for _ in range(10):
        poll_gauge(router, clock, 4, 2.0)
    assert router.group_states()["g0"].accept.ewma == after
    # /v1/loads alone (its lifetime mean of 2.4 in every poll) moves nothing.
    for _ in range(10):
        clock.now += 0.1
        assert router.monitor.poller is not None
        router.monitor.poller.publish(EAGLE, parse_v1_loads({"loads": [{
            "dp_rank": 0, "num_running_reqs": 4, "num_waiting_reqs": 0,
            "speculative": {"accept_length": 2.4, "accept_rate": 0.5}}]}, clock.now))
    assert router.group_states()["g0"].accept.ewma == after


def test_a_lone_requests_unlucky_window_barely_moves_the_average() -> None:
    # The seed-coding c=1 failure: one request's 40-step window read 1.6 (mean 2.0).
    # Polled at every 0.1 s, that window must count once, and as one request's.
    router, clock = make(goodput_probe_s=0)
    for i in range(40):
        poll_gauge(router, clock, 1, 2.0 + 0.01 * (i // 10) if i < 30 else 1.6)
    # One window of one request moves it 0.03, not 0.24; at seed-coding load 1 the
    # baseline needs it below 1.74.
    state = router.group_states()["g0"]
    assert state.accept.ewma is not None and state.accept.ewma > 1.9


def test_a_probe_reading_after_a_quiet_period_outweighs_the_stale_average() -> None:
    # The group sat on the baseline for a probe period (EAGLE idle, no readings): the
    # probe's first reading, one request's, must move the average most of the way, or a
    # recovered workload would need many probes to win EAGLE-3 back.
    router, clock = make(goodput_probe_s=8.0)
    for _ in range(10):
        poll(router, clock, 16, 0, 1.6)
    clock.now += 8.0  # a probe period without a reading
    poll(router, clock, 1, 0, 3.0)
    accept = router.group_states()["g0"].accept.ewma
    assert accept is not None and accept > 2.7  # 1.6 + 1.4 * 0.84 (e^-4 of weight kept)
    poll(router, clock, 1, 0, 1.6)  # right after: back to one request's small weight
    after = router.group_states()["g0"].accept.ewma
    assert after is not None and accept - after < 0.15
    # An idle server's snapshot after a quiet period is old steps: no such boost.
    clock.now += 8.0
    poll(router, clock, 0, 0, 1.0)
    idle = router.group_states()["g0"].accept.ewma
    assert idle is not None and after - idle < 0.15


def test_a_burst_behind_a_probe_carrier_is_seen_before_the_probe_goes() -> None:
    # 20 requests on the baseline after the accept length fell from 3.0 to 1.6: a probe
    # is due (crossover 61 at 3.0). 50 more arrive at once, as 50 did before (so a burst
    # that size is plausible): at 70 even 3.0 loses, so with the arrival window no probe
    # goes out; without it the first one carries one.
    async def burst(router: LoadAwareRouter) -> list[Target]:
        async def one() -> Target:
            await router.settle(CHAT)
            return admit(router)

        return list(await asyncio.gather(*(one() for _ in range(50))))

    def primed(window_s: float) -> LoadAwareRouter:
        router, clock = make(window_s=window_s, goodput_probe_s=0.5)
        for accept in [3.0] * 10 + [1.6] * 20:
            poll(router, clock, 16, 4, accept)
        assert router.choose(CHAT).pool == "baseline"  # the switch; probes due 0.5 s on
        for _ in range(10):
            poll(router, clock, 0, 20, 1.6)
        for _ in range(20):
            router.acquire(Target("g0", "baseline", GROUP[1], "held"))
        asyncio.run(seen(router))
        return router

    async def seen(router: LoadAwareRouter) -> None:
        await asyncio.gather(*(router.settle(CHAT) for _ in range(50)))

    assert sum(t.probe is not None for t in asyncio.run(burst(primed(0.0)))) == 1
    # a window far wider than the 50 arrivals take, even on a loaded host
    assert all(t.pool == "baseline" and t.probe is None
               for t in asyncio.run(burst(primed(0.2))))


def test_a_probe_wins_a_group_back_although_its_first_window_holds_old_steps() -> None:
    # The accept-shift trace's last phase: the average is 1.6 and stale, the probe runs at
    # accept 3.0, but SGLang counts its 40-batch windows across the quiet period, so the
    # first window still holds old steps. Only the decayed average against both windows
    # of the renewal lets the probe win the group back.
    router, clock = make(goodput_probe_s=3.0)
    for accept in [3.0, 3.01] * 20 + [1.6, 1.61] * 20:
        poll_gauge(router, clock, 24, accept)
        poll_base(router, clock, 0)
    for _ in range(LOAD):
        router.acquire(Target("g0", "baseline", GROUP[1], "held"))
    assert router.choose(CHAT).pool == "baseline"
    for _ in range(60):
        poll_gauge(router, clock, 0, 1.61)
        poll_base(router, clock, LOAD)
    assert router.choose(CHAT).probe is not None
    for running, accept in ((1, 2.2), (1, 3.0), (0, 3.0)):
        poll_gauge(router, clock, running, accept)
        poll_base(router, clock, LOAD)
    state = router.group_states()["g0"]
    assert state.accept.ewma is not None and state.accept.ewma > 2.9
    assert router.choose(CHAT).pool == "eagle"
