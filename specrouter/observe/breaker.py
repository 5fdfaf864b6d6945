"""Per-backend circuit breaker and health record: pure state machines, clock passed in.

closed --N failures within window_s--> open --cooldown_s--> half_open (one trial request
at a time); half_open --M successes--> closed; half_open --any failure--> open (the
cool-down restarts). A trial that ends without a verdict (its client left before the
engine answered, or it was recalled or handed over) frees its slot as it ends; one whose
end is never told frees it after probe_timeout_s.

The breaker sits on top of the active health checks because those are slow (SGLang's
/health runs a generation): passive outcomes of real requests react within a few requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class BreakerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_threshold: int = Field(default=5, ge=1, description="N failures in window open it")
    window_s: float = Field(default=10.0, gt=0)
    cooldown_s: float = Field(default=5.0, gt=0,
                              description="open this long before a half-open trial request")
    success_threshold: int = Field(default=2, ge=1, description="M trial successes close it")
    probe_timeout_s: float = Field(
        default=30.0, gt=0, description="a trial request with no outcome this long frees its slot")
    check_failures_to_down: int = Field(
        default=2, ge=1, description="consecutive failed active checks that mark it down")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    config: BreakerConfig = field(default_factory=BreakerConfig)
    _state: BreakerState = BreakerState.CLOSED
    _failures: deque[float] = field(default_factory=deque)
    _opened_at: float = 0.0
    _trial_started: float | None = None
    _trial_successes: int = 0

    @property
    def closed(self) -> bool:
        """Closed: requests may go here whatever the clock says. Open and half-open
        states change with time alone (the cool-down ends, a trial's slot frees)."""
        return self._state is BreakerState.CLOSED

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.config.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_started, self._trial_successes = None, 0
        return self._state

    def available(self, now: float) -> bool:
        """Could a request go here now (without claiming the half-open trial slot)?"""
        st = self.state(now)
        if st is BreakerState.CLOSED:
            return True
        if st is BreakerState.OPEN:
            return False
        return self._trial_started is None or (
            now - self._trial_started >= self.config.probe_timeout_s)

    def allow_request(self, now: float) -> bool:
        """Claim permission to send one request; in half_open this takes the trial slot."""
        if not self.available(now):
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._trial_started = now
        return True

    def end_trial(self, claimed_at: float) -> None:
        """The trial claimed at `claimed_at` ended without an outcome: its slot is free
        for the next request now. A trial that was recorded already, and any later
        trial, are left alone."""
        if self._state is BreakerState.HALF_OPEN and self._trial_started == claimed_at:
            self._trial_started = None

    def record_success(self, now: float) -> None:
        st = self.state(now)
        if st is BreakerState.HALF_OPEN:
            self._trial_started = None
            self._trial_successes += 1
            if self._trial_successes >= self.config.success_threshold:
                self._state = BreakerState.CLOSED
                self._failures.clear()

    def record_failure(self, now: float) -> None:
        st = self.state(now)
        if st is BreakerState.HALF_OPEN:
            self._open(now)
            return
        if st is BreakerState.OPEN:
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.config.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.config.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state, self._opened_at = BreakerState.OPEN, now
        self._trial_started, self._trial_successes = None, 0
        self._failures.clear()


@dataclass
class HealthRecord:
    """Active checks plus passive outcomes of one backend.

    Healthy = the last `check_failures_to_down` active checks did not all fail, and the
    breaker is not open (half_open counts as healthy only while its trial slot is free).
    Before the first check the backend is presumed up: the breaker catches a dead one.
    `on_change` is called whenever a check, an outcome or a claimed trial changed what
    `healthy` answers or how it depends on the clock.
    """

    config: BreakerConfig = field(default_factory=BreakerConfig)
    breaker: CircuitBreaker = field(init=False)
    check_failures: int = 0
    last_check_ok: bool | None = None
    last_check_at: float | None = None
    last_error: str | None = None
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.breaker = CircuitBreaker(self.config)

    def record_check(self, ok: bool, now: float, error: str | None = None) -> None:
        before = self._health_state()
        self.last_check_ok, self.last_check_at = ok, now
        self.check_failures = 0 if ok else self.check_failures + 1
        if error is not None or ok:
            self.last_error = error
        self._changed_from(before)

    def unchanged_by(self, ok: bool) -> bool:
        """Whether an outcome changes nothing: a success in a closed breaker."""
        return ok and self.breaker.closed

    def record_outcome(self, ok: bool, now: float, error: str | None = None) -> None:
        """A real request ended: ok=False for connection errors and 5xx."""
        if self.unchanged_by(ok):
            return
        before = self._health_state()
        if ok:
            self.breaker.record_success(now)
        else:
            self.breaker.record_failure(now)
            self.last_error = error
        self._changed_from(before)

    def checks_ok(self) -> bool:
        return self.check_failures < self.config.check_failures_to_down

    def healthy(self, now: float) -> bool:
        return self.checks_ok() and self.breaker.available(now)

    def allow_request(self, now: float) -> bool:
        """Call when dispatching to this backend (claims the half-open trial slot)."""
        if self.breaker.closed:
            return self.checks_ok()
        before = self._health_state()
        allowed = self.checks_ok() and self.breaker.allow_request(now)
        self._changed_from(before)
        return allowed

    def claim(self, now: float) -> float | None:
        """`allow_request`, and `now` when it took the half-open trial slot (None: it
        took none, or the request may not go here)."""
        trial = not self.breaker.closed and self.breaker.available(now)
        return now if self.allow_request(now) and trial else None

    def end_trial(self, claimed_at: float) -> None:
        """`CircuitBreaker.end_trial`."""
        before = self._health_state()
        self.breaker.end_trial(claimed_at)
        self._changed_from(before)

    def _health_state(self) -> tuple[bool, BreakerState, float | None]:
        b = self.breaker
        return self.checks_ok(), b._state, b._trial_started

    def _changed_from(self, before: tuple[bool, BreakerState, float | None]) -> None:
        if self.on_change is not None and self._health_state() != before:
            self.on_change()

    def as_dict(self, now: float) -> dict[str, object]:
        return {
            "healthy": self.healthy(now), "breaker": self.breaker.state(now).value,
            "last_check_ok": self.last_check_ok,
            "check_age_s": None if self.last_check_at is None else now - self.last_check_at,
            "last_error": self.last_error,
        }
