"""Circuit breaker transitions and the health record, on an injected clock."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specrouter.observe.breaker import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    HealthRecord,
)

CFG = BreakerConfig(failure_threshold=3, window_s=10, cooldown_s=5, success_threshold=2)


def test_opens_after_n_failures_within_window_only() -> None:
    b = CircuitBreaker(CFG)
    b.record_failure(0.0)
    b.record_failure(1.0)
    b.record_failure(12.0)  # the first two fell out of the window
    assert b.state(12.0) is BreakerState.CLOSED
    b.record_failure(13.0)
    b.record_failure(14.0)
    assert b.state(14.0) is BreakerState.OPEN and not b.allow_request(14.0)


def test_half_open_single_trial_then_close_after_m_successes() -> None:
    b = CircuitBreaker(CFG)
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert b.state(5.1) is BreakerState.OPEN  # opened at 0.2, cooldown 5 s
    assert b.state(5.2) is BreakerState.HALF_OPEN
    assert b.allow_request(5.2)
    assert not b.allow_request(5.3)  # one trial request at a time
    b.record_success(5.3)
    assert b.state(5.3) is BreakerState.HALF_OPEN  # 1 of 2
    assert b.allow_request(5.4)
    b.record_success(5.5)
    assert b.state(5.5) is BreakerState.CLOSED and b.allow_request(5.6)


def test_half_open_failure_reopens_and_restarts_cooldown() -> None:
    b = CircuitBreaker(CFG)
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert b.allow_request(6.0)
    b.record_failure(6.5)
    assert b.state(10.0) is BreakerState.OPEN
    assert b.state(11.5) is BreakerState.HALF_OPEN


def test_lost_trial_frees_its_slot_after_timeout() -> None:
    b = CircuitBreaker(CFG.model_copy(update={"probe_timeout_s": 2.0}))
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert b.allow_request(5.2)
    assert not b.available(6.0)
    assert b.available(7.3)


def test_health_record_combines_checks_and_outcomes() -> None:
    h = HealthRecord(CFG)
    assert h.healthy(0.0)  # presumed up before the first check
    h.record_check(False, 1.0, "connect refused")
    assert h.healthy(1.0)  # one failed check is not enough (check_failures_to_down=2)
    h.record_check(False, 2.0, "connect refused")
    assert not h.healthy(2.0) and h.as_dict(2.0)["last_error"] == "connect refused"
    h.record_check(True, 3.0)
    assert h.healthy(3.0)
    for t in (4.0, 4.1, 4.2):
        h.record_outcome(False, t, "HTTP 503")
    assert not h.healthy(4.3) and h.as_dict(4.3)["breaker"] == "open"
    assert h.claim(9.3) == 9.3 and not h.healthy(9.4)  # trial slot claimed
    assert h.claim(9.3) is None  # taken: no second trial, even at the same instant
    h.record_outcome(True, 9.5)
    assert h.allow_request(9.6)
    h.record_outcome(True, 9.7)
    assert h.as_dict(9.7)["breaker"] == "closed" and h.healthy(9.7)


def test_config_validation() -> None:
    with pytest.raises(ValidationError) as exc:
        BreakerConfig(failure_threshold=0, cooldown_s=-1)
    assert {e["loc"] for e in exc.value.errors()} == {("failure_threshold",), ("cooldown_s",)}


def test_a_trial_ended_without_an_outcome_frees_its_slot_at_once() -> None:
    b = CircuitBreaker(CFG)  # probe_timeout_s 30
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert b.allow_request(5.2)
    assert not b.available(5.3)
    b.end_trial(5.2)  # its client left before the engine answered
    assert b.available(5.3) and b.state(5.3) is BreakerState.HALF_OPEN
    # A later trial is not freed by the end of an earlier one...
    assert b.allow_request(5.4)
    b.end_trial(5.2)
    assert not b.available(5.5)
    # ...nor is a verdict undone: a recorded failure keeps the breaker open.
    b.record_failure(5.6)
    b.end_trial(5.4)
    assert b.state(5.7) is BreakerState.OPEN and not b.available(5.7)
