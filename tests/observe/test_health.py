"""Active health checks on SGLang 0.5.23's semantics: `/ready` answers 200 for a wedged
scheduler, `/health_generate` does not (SGLang runs it beside a busy batch, so no answer
means no progress); a check that fails on the router's own side says nothing about the
backend. Answers come from an httpx transport in SGLang's shapes (empty 200 bodies)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from loadtest import loopback
from specrouter.backends import Backend
from specrouter.config import HealthSettings
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker

EAGLE = Backend("e", "http://eagle", "eagle", "g")
SETTINGS = HealthSettings(interval_s=2.0, generation_check_s=10.0, generation_timeout_s=8.0)


class Engine:
    """What one SGLang 0.5.23 server answers: `wedged` leaves /health_generate unanswered."""

    def __init__(self) -> None:
        self.wedged = False
        self.local_failure = False
        self.generations = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.local_failure:
            raise httpx.ConnectError("connect failed") from OSError(
                errno.EMFILE, "Too many open files")
        if request.url.path == "/ready":
            return httpx.Response(200)
        if request.url.path == "/health_generate":
            self.generations += 1
            if self.wedged:
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(200)
        return httpx.Response(404)


def checker(engine: Engine, clock: list[float]) -> HealthChecker:
    client = loopback.async_client(transport=httpx.MockTransport(engine))
    return HealthChecker([EAGLE], SETTINGS, BreakerConfig(), clock=lambda: clock[0],
                         client=client)


def run_checks(health: HealthChecker, clock: list[float], n: int,
               after: Callable[[], None] = lambda: None) -> list[bool]:
    async def run() -> list[bool]:
        verdicts = []
        for _ in range(n):
            clock[0] += SETTINGS.interval_s
            verdicts.append(await health.check_once(EAGLE))
            after()
        return verdicts
    return asyncio.run(run())


def test_a_wedged_scheduler_is_found_although_ready_answers() -> None:
    engine, clock = Engine(), [100.0]
    health = checker(engine, clock)
    assert run_checks(health, clock, 6) == [True] * 6
    assert engine.generations == 2  # one generation check per 10 s, not per check
    engine.wedged = True
    verdicts = run_checks(health, clock, 8)
    assert verdicts[-1] is False
    assert not all(verdicts) and not health.healthy("e")
    info = health.describe("e")
    assert info["check_path"] == "/ready"
    assert "wedged" in str(info["last_error"]) and "/ready answers 200" in str(info["last_error"])
    # While wedged, every check repeats the generation; progress brings the backend back.
    before = engine.generations
    run_checks(health, clock, 1)
    assert engine.generations == before + 1
    engine.wedged = False
    assert run_checks(health, clock, 1) == [True]
    assert health.healthy("e") and health.describe("e")["generation_check_error"] is None


def test_the_generation_timeout_allows_for_sglangs_one_second_poll() -> None:
    with pytest.raises(ValidationError, match="generation_timeout_s"):
        HealthSettings(generation_timeout_s=0.5)


def test_a_failure_on_the_routers_side_keeps_the_last_state() -> None:
    engine, clock = Engine(), [100.0]
    health = checker(engine, clock)
    run_checks(health, clock, 1)
    engine.local_failure = True
    assert run_checks(health, clock, 5) == [True] * 5
    record = health.records["e"]
    assert health.healthy("e") and record.check_failures == 0 and record.last_error is None
    # The same holds for a backend already down: a local failure does not bring it back.
    engine.local_failure, engine.wedged = False, True
    run_checks(health, clock, 3)
    assert not health.healthy("e")
    engine.local_failure = True
    assert run_checks(health, clock, 3) == [False] * 3
    assert not health.healthy("e")


BACKENDS = tuple(Backend(f"b{i}", f"http://b{i}", "baseline", "g") for i in range(3))
FLAG_BREAKER = BreakerConfig(failure_threshold=2, window_s=5.0, cooldown_s=1.0,
                             success_threshold=1, probe_timeout_s=2.0,
                             check_failures_to_down=2)
_STEP = st.one_of(
    st.tuples(st.just("check"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("outcome"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("dispatch"), st.integers(0, 2), st.just(True)),
    st.tuples(st.just("wait"), st.integers(1, 30), st.just(True)),  # tenths of a second
    st.tuples(st.just("read"), st.just(0), st.just(True)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=60))
def test_the_kept_health_flags_read_as_every_backend_asked_now(steps: list[Any]) -> None:
    """`flags` keeps its answer while every breaker is closed; at any point of any
    sequence of checks, outcomes, dispatches (which claim a half-open trial) and waits
    (which end cool-downs and free trials) it equals `healthy` asked backend by backend."""
    clock = [0.0]
    health = HealthChecker(BACKENDS, SETTINGS, FLAG_BREAKER, clock=lambda: clock[0])
    names = tuple(b.name for b in BACKENDS)
    for kind, i, ok in steps:
        name = names[i % len(names)]
        if kind == "check":
            health.records[name].record_check(ok, clock[0])
        elif kind == "outcome":
            health.record_outcome(name, ok)
        elif kind == "dispatch":
            health.claim(name, clock[0])
        elif kind == "wait":
            clock[0] += i / 10
        assert health.flags(names, clock[0]) == tuple(health.healthy(n, clock[0])
                                                       for n in names)
