"""Fault drills on real processes: each injects one failure through the simulator's
control endpoint (or kills a process), runs a few requests through the router, and checks
that none that could have been served was lost, every failed one got a clear error, and
the router's in-flight counts are back to zero."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from loadtest import loopback
from tests.drills.conftest import (
    FAST_BREAKER,
    DrillFactory,
    Outcome,
    assert_alive,
    assert_idle,
    call,
    chat_body,
    run_load,
)
from tests.fixtures.procs import ManagedProcess, wait_until

SHORT = chat_body(8)


def _failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.ok]


def test_refused_connections_are_retried_on_the_sibling_none_lost(drill: DrillFactory) -> None:
    d = drill()
    d.sim().control("eagle", refuse_connections=True)
    outcomes = asyncio.run(run_load(d.url, 12, 4, SHORT))
    assert _failures(outcomes) == [], _failures(outcomes)
    assert {o.pool for o in outcomes} == {"baseline"}
    d.wait_backend("gpu0-eagle", lambda b: not b["healthy"], "marked down")
    d.sim().control("eagle", refuse_connections=False)
    d.wait_backend("gpu0-eagle", lambda b: b["healthy"], "back up")
    assert_idle(d.router)
    assert_alive(d.router)


def test_5xx_answers_pass_through_then_the_breaker_moves_traffic(drill: DrillFactory) -> None:
    d = drill()
    d.sim().control("eagle", error_rate=1.0, error_status=500)
    first = asyncio.run(run_load(d.url, 6, 1, SHORT))  # one at a time: the breaker counts
    then = asyncio.run(run_load(d.url, 10, 4, SHORT))
    failed = _failures(first)
    # A 500 is the engine's answer, not a transport failure: it reaches the client as
    # the engine's own error, until the breaker opens and the group uses its baseline.
    assert 1 <= len(failed) <= FAST_BREAKER["failure_threshold"], first
    assert all(o.status == 500 and "injected" in (o.error or "") for o in failed)
    assert _failures(then) == [] and {o.pool for o in then} == {"baseline"}, then
    assert_idle(d.router)


def test_a_half_open_trial_whose_client_leaves_frees_the_backend_as_it_ends(
        drill: DrillFactory) -> None:
    """The one trial request a half-open breaker lets through, its client gone before the
    engine answered: the backend takes requests again once that request is released,
    not after the trial's timeout (`probe_timeout_s`, 30 s)."""
    d = drill(env={"SPECROUTER_UPSTREAM__ABANDONED_HOLD_S": "1.0"})
    d.sim().control("eagle", error_rate=1.0, error_status=500)
    asyncio.run(run_load(d.url, 6, 1, SHORT))
    d.wait_backend("gpu0-eagle", lambda b: b["breaker"] == "half_open", "half-open")
    d.sim().control("eagle", error_rate=0.0, added_latency_ms=1500.0)

    async def trial_then_leave() -> None:
        async with loopback.async_client(timeout=30.0) as client:
            trial = asyncio.ensure_future(
                client.post(f"{d.url}/v1/chat/completions", json=SHORT))
            await asyncio.to_thread(d.wait_backend, "gpu0-eagle",
                                    lambda b: not b["healthy"], "its trial taken", 5.0)
            trial.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trial

    asyncio.run(trial_then_leave())
    d.wait_backend("gpu0-eagle", lambda b: b["healthy"] and b["breaker"] == "half_open",
                   "the trial's slot free, its request released", timeout=10.0)
    d.sim().control("eagle", added_latency_ms=0.0)
    then = asyncio.run(run_load(d.url, 4, 1, SHORT))
    assert _failures(then) == [] and {o.pool for o in then} == {"eagle"}, then
    assert d.backend("gpu0-eagle")["breaker"] == "closed"
    assert_idle(d.router)


def test_503_is_retried_on_the_sibling_none_lost(drill: DrillFactory) -> None:
    d = drill()
    d.sim().control("eagle", error_rate=1.0, error_status=503)
    outcomes = asyncio.run(run_load(d.url, 12, 4, SHORT))
    assert _failures(outcomes) == [] and {o.pool for o in outcomes} == {"baseline"}, outcomes
    assert_idle(d.router)


def test_stalled_server_times_out_with_504_then_the_breaker_moves_traffic(
    drill: DrillFactory,
) -> None:
    d = drill(timeouts={"connect": 1.0, "first_byte": 1.0, "total": 5.0})
    d.sim().control("eagle", stall=True)
    first = asyncio.run(run_load(d.url, 3, 3, SHORT))
    assert all(o.status == 504 and "timed out" in (o.error or "") for o in first), first
    then = asyncio.run(run_load(d.url, 10, 4, SHORT))
    assert _failures(then) == [] and {o.pool for o in then} == {"baseline"}, then
    # The stalled engine saw the timed-out requests go: nothing of them left running.
    wait_until(lambda: d.sim().state("eagle")["waiting"] + d.sim().state("eagle")["running"]
               == 0, 10.0, "the stalled engine to hold nothing")
    assert_idle(d.router)


def test_stream_cut_mid_way_ends_with_an_error_event(drill: DrillFactory) -> None:
    d = drill()
    d.sim().control("eagle", cut_stream_after_tokens=3)
    d.sim().control("baseline", cut_stream_after_tokens=3)
    outcomes = asyncio.run(run_load(d.url, 6, 3, chat_body(20)))
    assert outcomes and all(o.status == 200 and not o.ok for o in outcomes), outcomes
    assert all("before [DONE]" in (o.error or "") or "failed" in (o.error or "")
               for o in outcomes), outcomes
    d.sim().control("eagle", cut_stream_after_tokens=None)
    d.sim().control("baseline", cut_stream_after_tokens=None)
    # Broken streams count as failures: the breakers may have opened; they close again.
    for name in ("gpu0-eagle", "gpu0-baseline"):
        d.wait_backend(name, lambda b: b["healthy"], "healthy again")
    assert _failures(asyncio.run(run_load(d.url, 4, 2, SHORT))) == []
    assert_idle(d.router)


def test_slow_health_checks_mark_the_server_down_traffic_moves_none_lost(
    drill: DrillFactory,
) -> None:
    d = drill()
    d.sim().control("eagle", slow_health_ms=2000)  # > ready_timeout_s 0.5
    d.wait_backend("gpu0-eagle", lambda b: not b["healthy"], "down on slow checks")
    outcomes = asyncio.run(run_load(d.url, 10, 4, SHORT))
    assert _failures(outcomes) == [] and {o.pool for o in outcomes} == {"baseline"}, outcomes
    d.sim().control("eagle", slow_health_ms=0)
    d.wait_backend("gpu0-eagle", lambda b: b["healthy"], "up again")
    assert_idle(d.router)


def _kill(process: ManagedProcess) -> None:
    assert process.proc is not None
    os.killpg(process.proc.pid, signal.SIGKILL)
    process.proc.wait(10)


def test_whole_group_killed_mid_stream_then_back(drill: DrillFactory) -> None:
    """Two GPU groups; gpu0's process is SIGKILLed while streams run on both. Streams on
    gpu0 end with an error event, gpu1's finish, new requests all land on gpu1; gpu0
    restarted on the same ports takes traffic again."""
    d = drill(groups=("gpu0", "gpu1"), time_scale=0.2)
    long_body = chat_body(600)
    results: list[Outcome] = []

    async def streams() -> None:
        async with loopback.async_client(timeout=60.0) as client:
            tasks = [asyncio.ensure_future(call(client, f"{d.url}/v1/chat/completions",
                                                long_body, timeout=60.0)) for _ in range(4)]
            seen: dict[str, int] = {}

            def both_groups_busy() -> bool:
                # every stream is on an engine, not only in the router's counts: a stream
                # still connecting when gpu0 dies is retried, not cut
                for g in ("gpu0", "gpu1"):
                    states = [loopback.get(f"{url}/sim/state").json()
                              for url in (d.sim(g).eagle_url, d.sim(g).baseline_url)]
                    seen[g] = sum(s["running"] + s["waiting"] for s in states)
                return sum(seen.values()) == 4 and all(seen.values())

            try:
                await asyncio.to_thread(wait_until, both_groups_busy, 20.0, "streams")
            except TimeoutError as timeout:
                ended = [t.result() for t in tasks if t.done()]
                raise AssertionError(f"streams on both groups, engines run {seen}, ended: "
                                     f"{ended}; router: {d.router.process.output()[-3000:]}"
                                     ) from timeout
            _kill(d.sim("gpu0").process)
            results.extend(await asyncio.gather(*tasks))

    asyncio.run(streams())
    cut = [o for o in results if not o.ok]
    assert cut and all(o.status == 200 and o.error for o in cut), results  # error events
    assert any(o.ok for o in results), results  # gpu1's streams finished
    for name in ("gpu0-eagle", "gpu0-baseline"):
        d.wait_backend(name, lambda b: not b["healthy"], "down after the kill")
    during = asyncio.run(run_load(d.url, 10, 4, chat_body(8)))
    assert _failures(during) == [], during
    assert_idle(d.router)

    back = ManagedProcess(d.sim("gpu0").process.argv).start()
    try:
        back.wait_http(f"{d.sim('gpu0').eagle_url}/sim/state", timeout=30.0)
        for name in ("gpu0-eagle", "gpu0-baseline"):
            d.wait_backend(name, lambda b: b["healthy"], "healthy again")
        after = asyncio.run(run_load(d.url, 12, 6, chat_body(8)))
        assert _failures(after) == [], after
        assert loopback.get(f"{d.sim('gpu0').eagle_url}/sim/state").json()["requests"] \
            + loopback.get(f"{d.sim('gpu0').baseline_url}/sim/state").json()["requests"] > 0
        assert_idle(d.router)
        assert_alive(d.router)
    finally:
        back.stop()
