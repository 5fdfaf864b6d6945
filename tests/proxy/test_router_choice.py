"""The default routing seam: prefer EAGLE-3, fall back, exclude on retry, exact counts."""

from __future__ import annotations

import pytest

from specrouter.routing.router import (
    Backend,
    InflightTracker,
    NoBackendAvailable,
    PassiveHealth,
    PreferEagleRouter,
    RequestInfo,
)

BACKENDS = [
    Backend("g0-e", "http://h:1", "eagle", "g0"),
    Backend("g0-b", "http://h:2", "baseline", "g0"),
    Backend("g1-e", "http://h:3", "eagle", "g1"),
    Backend("g1-b", "http://h:4", "baseline", "g1"),
]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[PreferEagleRouter, Clock]:
    clock = Clock()
    names = [b.name for b in BACKENDS]
    return PreferEagleRouter(BACKENDS, PassiveHealth(names, 2.0, clock)), clock


def test_prefers_eagle_of_the_least_busy_group() -> None:
    router, _ = make()
    first = router.choose(RequestInfo("/v1/chat/completions"))
    assert (first.pool, first.group, first.reason) == ("eagle", "g0", "prefer_eagle")
    router.acquire(first)
    second = router.choose(RequestInfo("/v1/chat/completions"))
    assert (second.backend.name, second.pool) == ("g1-e", "eagle")
    router.release(first)
    assert router.inflight("g0-e") == 0


def test_group_load_counts_both_servers_of_the_gpu() -> None:
    router, _ = make()
    busy_baseline = router.choose(RequestInfo("/v1/models", pool="baseline"))
    assert busy_baseline.backend.name == "g0-b"
    router.acquire(busy_baseline)
    assert router.choose(RequestInfo("/v1/chat/completions")).group == "g1"


def test_route_pool_and_fallback_to_the_other_pool() -> None:
    router, _ = make()
    assert router.choose(RequestInfo("/v1/files", pool="baseline")).pool == "baseline"
    for name in ("g0-b", "g1-b"):
        router.record_outcome(name, False, "refused")
    target = router.choose(RequestInfo("/v1/files", pool="baseline"))
    assert (target.pool, target.reason) == ("eagle", "route_pool_unavailable")


def test_failed_backend_cools_down_then_returns() -> None:
    router, clock = make()
    for name in ("g0-e", "g1-e"):
        router.record_outcome(name, False, "connection refused")
    target = router.choose(RequestInfo("/v1/chat/completions"))
    assert (target.pool, target.reason) == ("baseline", "eagle_unavailable")
    assert router.details()["backends"][0]["last_error"] == "connection refused"
    clock.now += 2.0
    assert router.choose(RequestInfo("/v1/chat/completions")).pool == "eagle"


def test_exclude_and_no_backend() -> None:
    router, _ = make()
    everyone = frozenset(b.name for b in BACKENDS)
    target = router.choose(RequestInfo("/generate", exclude=everyone - {"g1-b"}))
    assert (target.backend.name, target.reason) == ("g1-b", "retry_eagle_unavailable")
    with pytest.raises(NoBackendAvailable):
        router.choose(RequestInfo("/generate", exclude=everyone))


def test_tracker_never_goes_negative() -> None:
    tracker = InflightTracker(["a"])
    tracker.acquire("a")
    tracker.release("a")
    with pytest.raises(RuntimeError, match="release without acquire"):
        tracker.release("a")
    assert tracker.total() == 0
