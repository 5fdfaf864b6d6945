"""Credit rule, staleness and load signals of the load view."""

from __future__ import annotations

import random
from dataclasses import fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrouter.observe.loadview import (
    ACCEPT_MAX_AGE_S,
    HISTORY_S,
    SNAPSHOT_MAX_AGE_S,
    BackendView,
    EngineSample,
    GroupView,
    InflightHistory,
    LoadView,
)


def view() -> LoadView:
    lv = LoadView(poll_interval=0.1)
    lv.add_backend("e0", "gpu0", "eagle")
    lv.add_backend("b0", "gpu0", "baseline")
    lv.add_backend("e1", "gpu1", "eagle")
    return lv


def test_credit_rule_counts_dispatches_once() -> None:
    lv = view()
    for _ in range(3):
        lv.acquire("e0", 9.0)
    # The engine saw our 3 plus 2 from elsewhere.
    lv.publish("e0", EngineSample(running=4, waiting=1, received_at=10.0))
    assert lv.backend_view("e0", 10.0).engine == 5.0  # not 5 + 3
    lv.acquire("e0", 10.01)
    lv.acquire("e0", 10.02)  # dispatched since the poll: credited
    assert lv.backend_view("e0", 10.05).engine == 7.0
    lv.release("e0", 10.03)  # one of ours finished since the poll: debited
    v = lv.backend_view("e0", 10.05)
    assert (v.engine, v.inflight) == (6.0, 4)
    assert (v.load("inflight"), v.load("engine"), v.load("max")) == (4.0, 6.0, 6.0)


def test_a_request_that_ends_while_the_poll_is_on_the_wire_is_no_phantom() -> None:
    lv = view()
    lv.acquire("e0", 9.9)
    lv.poll_started("e0", 9.95)  # the engine's snapshot will still hold our one request
    lv.release("e0", 9.97)  # it ends before the answer arrives
    lv.publish("e0", EngineSample(running=1, waiting=0, received_at=10.0))
    assert lv.backend_view("e0", 10.01).engine == 0.0  # not a phantom 1 for a poll interval
    # A request dispatched during the round trip and already in the snapshot: counted once.
    lv.poll_started("e0", 10.05)
    lv.acquire("e0", 10.07)
    lv.publish("e0", EngineSample(running=1, waiting=0, received_at=10.1))
    assert lv.backend_view("e0", 10.11).engine == 1.0


def test_the_snapshot_age_moves_the_credit_rule_to_the_snapshot_moment() -> None:
    # SGLang 0.5.23 answers from a snapshot built earlier (its per-rank timestamp): a
    # request that ended after the snapshot but before the poll is still in its count.
    lv = view()
    lv.acquire("e0", 9.0)
    lv.acquire("e0", 9.0)
    lv.release("e0", 9.8)  # after the snapshot of 9.6, before the poll of 9.95
    lv.poll_started("e0", 9.95)
    lv.publish("e0", EngineSample(2, 0, 10.0, snapshot_age=0.4))
    assert lv.backend_view("e0", 10.0).engine == 1.0  # not a phantom 2
    # Without the age the same answer counts the ended request twice... as a phantom.
    lv.poll_started("e0", 10.05)
    lv.publish("e0", EngineSample(2, 0, 10.1))
    assert lv.backend_view("e0", 10.1).engine == 2.0
    # A request dispatched after the snapshot is credited on top of it.
    lv.acquire("e0", 10.15)
    lv.poll_started("e0", 10.2)
    lv.publish("e0", EngineSample(1, 0, 10.25, snapshot_age=0.2))
    assert lv.backend_view("e0", 10.25).engine == 2.0


def test_an_old_snapshot_is_stale_however_fresh_the_answer() -> None:
    lv = view()
    lv.publish("b0", EngineSample(7, 0, 50.0, snapshot_age=0.5))
    fresh = lv.backend_view("b0", 50.0)
    assert not fresh.stale and fresh.engine == 7.0
    assert fresh.telemetry_age == pytest.approx(0.5)  # the snapshot's, not the answer's
    # A wedged scheduler's snapshot ages while /v1/loads keeps answering it.
    lv.publish("b0", EngineSample(7, 0, 51.0, snapshot_age=SNAPSHOT_MAX_AGE_S + 0.1))
    old = lv.backend_view("b0", 51.0)
    assert old.stale and old.engine is None and old.load("max") == 0.0


def test_inflight_history_keeps_the_count_of_every_moment() -> None:
    h = InflightHistory()
    for t, count in ((1.0, 1), (2.0, 2), (3.0, 1), (4.0, 0)):
        h.record(t, count)
    assert h.peak(2.5, 2.9) == 2  # in force since 2.0
    assert h.peak(3.5, 5.0) == 1  # 1 until 4.0
    assert h.peak(0.0, 0.5) == 0  # before the first request
    h.record(4.0 + HISTORY_S + 1.0, 1)  # older changes are dropped...
    assert len(h.changes) <= 2
    assert h.peak(4.5, 4.6) == 0  # ...but the count they left is kept


def test_engine_below_inflight_and_floor() -> None:
    lv = view()
    lv.acquire("e0", 0.9)
    lv.acquire("e0", 0.9)
    lv.publish("e0", EngineSample(0, 0, 1.0))  # engine has not seen them yet
    v = lv.backend_view("e0", 1.0)
    assert (v.load("engine"), v.load("max")) == (0.0, 2.0)
    lv.release("e0", 1.0)
    lv.release("e0", 1.0)
    assert lv.backend_view("e0", 1.0).engine == 0.0  # floored, never negative


def test_stale_telemetry_is_ignored_and_counted() -> None:
    lv = view()
    lv.acquire("b0", 99.0)
    lv.publish("b0", EngineSample(running=30, waiting=5, received_at=100.0))
    fresh = lv.backend_view("b0", 100.3)  # 3 intervals: still fresh
    assert not fresh.stale and fresh.load("engine") == 35.0
    stale = lv.backend_view("b0", 100.31)
    assert stale.stale and stale.engine is None
    assert stale.load("engine") == stale.load("max") == 1.0  # falls back to in-flight
    assert stale.telemetry_age == pytest.approx(0.31)
    assert lv.stale_reads()["b0"] == 1
    lv.backend_view("b0", 101.0)
    assert lv.stale_reads()["b0"] == 2
    never = lv.backend_view("e1", 0.0)  # no telemetry yet: not a stale read
    assert never.engine is None and lv.stale_reads()["e1"] == 0


def test_out_of_order_sample_is_dropped() -> None:
    lv = view()
    lv.publish("e0", EngineSample(5, 0, 2.0))
    lv.publish("e0", EngineSample(9, 0, 1.0))
    assert lv.backend_view("e0", 2.0).engine == 5.0


def test_group_load_is_sum_and_accept_length_flows() -> None:
    lv = view()
    lv.acquire("e0", 4.0)
    lv.publish("e0", EngineSample(2, 0, 5.0, accept_length=3.1))
    lv.publish("b0", EngineSample(7, 3, 5.0))
    groups = {g.name: g for g in lv.snapshot(5.0, healthy=lambda n: n != "e1")}
    assert set(groups) == {"gpu0", "gpu1"}
    assert groups["gpu0"].load("engine") == 12.0
    assert groups["gpu0"].load("inflight") == 1.0
    assert groups["gpu0"].eagle_accept() == (3.1, 5.0)
    assert not groups["gpu1"].any_healthy
    lv.publish_accept("e1", EngineSample(3, 0, 6.0, accept_length=2.2))
    assert lv.group_view("gpu1", 6.0).eagle_accept() == (2.2, 6.0)
    assert lv.group_view("gpu1", 40.0).eagle_accept() == (None, None)  # too old


def test_misuse_is_a_clear_error() -> None:
    lv = view()
    with pytest.raises(RuntimeError, match="release without acquire"):
        lv.release("e0", 0.0)
    with pytest.raises(KeyError, match="unknown backend"):
        lv.acquire("nope", 0.0)
    with pytest.raises(ValueError, match="already registered"):
        lv.add_backend("e0", "gpu0", "eagle")


@settings(deadline=None)
@given(st.lists(st.sampled_from(["acquire", "release", "publish"]), max_size=80),
       st.integers(min_value=0, max_value=5))
def test_credit_rule_equals_engine_truth(ops: list[str], others: int) -> None:
    """If the engine counted exactly our in-flight plus `others` at each sample, the
    credited engine load always equals our in-flight plus `others`."""
    lv = LoadView(poll_interval=1.0)
    lv.add_backend("b", "g", "baseline")
    t = 0.0
    for op in ops:
        t += 0.01
        ours = lv.backends["b"].inflight
        if op == "acquire":
            lv.acquire("b", t)
        elif op == "release" and ours > 0:
            lv.release("b", t)
        elif op == "publish":
            lv.publish("b", EngineSample(running=ours + others, waiting=0, received_at=t))
        v = lv.backend_view("b", t)
        if v.engine is not None:
            assert v.engine == v.inflight + others


def _without_age(groups: tuple[GroupView, ...]) -> list[tuple[str, list[BackendView]]]:
    return [(g.name, [replace(b, telemetry_age=None) for b in g.backends]) for g in groups]


def test_the_snapshot_is_built_once_until_something_it_read_changes() -> None:
    lv = view()
    lv.publish("b0", EngineSample(2, 0, 10.0))
    first = lv.snapshot(10.05)
    assert lv.snapshot(10.06) is first  # nothing changed: the same views
    lv.acquire("e0", 10.07)
    after = lv.snapshot(10.07)
    assert after is not first and after[0].backends[1].inflight == 1
    assert lv.snapshot(10.08, lambda n: n != "e0") is not after  # a health flag changed
    lv.publish_accept("e0", EngineSample(0, 0, 10.09, accept_length=2.5))
    assert lv.snapshot(10.09)[0].eagle_accept() == (2.5, 10.09)


def test_a_cached_snapshot_still_goes_stale_at_each_deadline() -> None:
    lv = view()
    lv.publish("b0", EngineSample(30, 5, 100.0))  # stale after 3 poll intervals
    lv.publish("e1", EngineSample(1, 0, 100.2, snapshot_age=1.95))  # old snapshot: 2 s
    lv.publish_accept("e0", EngineSample(0, 0, 100.0, accept_length=3.0))
    fresh = lv.snapshot(100.2)
    assert fresh[0].backends[0].engine == 35.0 and fresh[1].backends[0].engine == 1.0
    assert lv.snapshot(100.25)[1].backends[0].engine == 1.0  # 2.0 s: not older than the max
    aged = lv.snapshot(100.26)  # the snapshot behind e1 is older than 2 s, no new reading
    assert aged[1].backends[0].stale and aged[1].backends[0].engine is None
    assert lv.snapshot(100.3)[0].backends[0].engine == 35.0
    stale = lv.snapshot(100.31)
    assert stale[0].backends[0].stale and stale[0].backends[0].engine is None
    assert stale[0].eagle_accept() == (3.0, 100.0)
    assert lv.snapshot(130.0)[0].eagle_accept() == (3.0, 100.0)  # 30 s: still usable
    assert lv.snapshot(130.01)[0].eagle_accept() == (None, None)
    # Every read of a stale sample counts, cached or not.
    before = lv.stale_reads()["b0"]
    lv.snapshot(130.01)
    assert lv.stale_reads()["b0"] == before + 1


_OPS = st.lists(st.tuples(st.sampled_from(["acquire", "release", "publish", "accept", "wait",
                                           "flag"]),
                          st.sampled_from(["e0", "b0", "e1"]),
                          st.floats(0.0, 0.4), st.floats(0.0, 2.5)), max_size=40)


def _reference(lv: LoadView, name: str, now: float, healthy: bool) -> BackendView:
    """A backend's view built field by field from its counters, through the dataclass's
    own constructor: what `LoadView` hands out must equal it."""
    b = lv.backends[name]
    fresh = b.accept_seen_at is not None and now - b.accept_seen_at <= ACCEPT_MAX_AGE_S
    return BackendView(
        name=b.name, pool=b.pool, healthy=healthy, inflight=b.inflight,
        engine=b.engine_load(now, lv.poll_interval), telemetry_age=b.age(now),
        stale=b.is_stale(now, lv.poll_interval),
        accept_length=b.accept_length if fresh else None,
        accept_seen_at=b.accept_seen_at if fresh else None,
        accept_batch=b.accept_batch if fresh else None,
        accept_window=b.accept_window if fresh else None)


def _reads(g: GroupView) -> tuple[object, ...]:
    """Everything a decision reads of a group view (its backends by name: their views
    are compared apart, their telemetry age aside)."""
    return (g.any_healthy, *(g.load(s) for s in ("inflight", "engine", "max")),
            *(tuple(b.name for b in g.servers(p)) for p in ("eagle", "baseline")),
            *(tuple(b.name for b in g.healthy_servers(p)) for p in ("eagle", "baseline")),
            g.pool_healthy("eagle"), g.pool_healthy("baseline"), g.eagle_accept(),
            g.eagle_accept_batch(), g.eagle_accept_window())


def _direct_reads(g: GroupView) -> tuple[object, ...]:
    """`_reads` computed from the backends, not through the group view's own reads."""
    def servers(pool: str, healthy: bool = False) -> tuple[str, ...]:
        return tuple(b.name for b in g.backends if b.pool == pool and (b.healthy or not healthy))

    fresh = [b for b in g.backends if b.pool == "eagle" and b.accept_length is not None
             and b.accept_seen_at is not None]
    best = max(fresh, key=lambda b: b.accept_seen_at or 0.0, default=None)
    return (any(b.healthy for b in g.backends),
            *(sum(b.load(s) for b in g.backends) for s in ("inflight", "engine", "max")),
            servers("eagle"), servers("baseline"), servers("eagle", True),
            servers("baseline", True), bool(servers("eagle", True)),
            bool(servers("baseline", True)),
            (None, None) if best is None else (best.accept_length, best.accept_seen_at),
            None if best is None else best.accept_batch,
            None if best is None else best.accept_window)


def test_a_view_holds_every_field_of_the_dataclass() -> None:
    lv = view()
    lv.publish_accept("e0", EngineSample(3, 0, 1.0, accept_length=2.0, accept_window=(2.0,)))
    built = lv.backend_view("e0", 1.0)
    assert set(vars(built)) == {f.name for f in fields(BackendView)}
    assert built == _reference(lv, "e0", 1.0, True)
    assert hash(built) == hash(_reference(lv, "e0", 1.0, True))


def test_a_group_view_reads_the_same_however_often_and_with_its_sustained_load() -> None:
    lv = view()
    lv.acquire("e0", 1.0)
    lv.publish("b0", EngineSample(4, 1, 1.0))
    g = lv.snapshot(1.0)[0]
    first = _reads(g)
    assert _reads(g) == first == _direct_reads(g)
    again = g.with_sustained(7.5)
    assert again.sustained == 7.5 and again == replace(g, sustained=7.5)
    assert _reads(again) == first == _reads(GroupView(g.name, g.backends))


@settings(max_examples=300, deadline=None)
@given(_OPS, st.lists(st.booleans(), min_size=40, max_size=40))
def test_a_cached_snapshot_reads_as_a_fresh_build(ops: list[tuple[str, str, float, float]],
                                                   read: list[bool]) -> None:
    # Reads are skipped at random, so several counts, readings and flips may fall between
    # two reads of the cached snapshot.
    lv, now, down = view(), 0.0, set[str]()

    def healthy(name: str) -> bool:
        return name not in down

    for (op, name, dt, x), reading in zip(ops, read, strict=False):
        now += dt if op == "wait" else dt / 10
        if op == "acquire":
            lv.acquire(name, now)
        elif op == "release" and lv.backends[name].inflight:
            lv.release(name, now)
        elif op == "publish":
            lv.publish(name, EngineSample(int(x * 4), 0, now, accept_length=1 + x,
                                          snapshot_age=x if x < 2.1 else None))
        elif op == "accept":
            lv.publish_accept(name, EngineSample(0, 0, now - x * 20, accept_length=2 + x))
        elif op == "flag":
            down ^= {name}
        for g in lv.group_names():
            assert lv.group_inflight(g) == sum(b.inflight for b in lv.backends.values()
                                               if b.group == g)
        if not reading:
            continue
        reads = dict(lv.stale_reads())
        cached = lv.snapshot(now, healthy)
        counted = dict(lv.stale_reads())
        fresh = tuple(GroupView(g, tuple(_reference(lv, n, now, healthy(n))
                                         for n in sorted(lv.backends)
                                         if lv.backends[n].group == g))
                      for g in lv.group_names())
        assert _without_age(cached) == _without_age(fresh)
        assert [_reads(g) for g in cached] == [_direct_reads(g) for g in fresh]
        for b in (b for g in fresh for b in g.backends):
            read_stale = b.stale and lv.backends[b.name].sample is not None
            assert counted[b.name] - reads[b.name] == int(read_stale)


def _spans_by_a_forward_walk(h: InflightHistory, start: float,
                             end: float) -> list[tuple[float, int]]:
    """What `_spans` means, read from the oldest change on."""
    spans: list[tuple[float, int]] = []
    t_prev, count = start, h.before
    for t, c in h.changes:
        if t > end:
            break
        if t > start:
            spans.append((t - t_prev, count))
            t_prev = t
        count = c
    spans.append((max(0.0, end - t_prev), count))
    return spans


def test_inflight_history_spans_match_a_walk_from_the_oldest_change() -> None:
    rng = random.Random(5)
    for _ in range(200):
        h = InflightHistory()
        now, count = 0.0, 0
        for _ in range(rng.randrange(0, 40)):
            now += rng.choice((0.0, 0.01, 0.3, 1.0))  # equal times too
            count = max(0, count + rng.choice((-1, 1)))
            h.record(now, count)
        for _ in range(20):
            start = rng.uniform(-1.0, now + 1.0)
            end = start + rng.choice((0.0, rng.uniform(0.0, 3.0)))
            assert h._spans(start, end) == _spans_by_a_forward_walk(h, start, end)
            if h.changes:  # the window's ends on a change
                t = rng.choice(h.changes)[0]
                assert h._spans(t, t + 0.5) == _spans_by_a_forward_walk(h, t, t + 0.5)
                assert h._spans(t - 0.5, t) == _spans_by_a_forward_walk(h, t - 0.5, t)


def test_an_idle_engines_sample_holds_for_three_idle_polls() -> None:
    lv = LoadView(poll_interval=0.1, idle_poll_interval=1.0)
    lv.add_backend("e0", "gpu0", "eagle")
    lv.add_backend("b0", "gpu0", "baseline")
    lv.publish("e0", EngineSample(0, 0, 10.0))  # idle, nothing of ours in flight
    lv.publish("b0", EngineSample(2, 0, 10.0))  # busy: judged by the busy interval
    assert not lv.backend_view("e0", 12.9).stale
    assert lv.backend_view("e0", 13.1).stale
    assert lv.backend_view("b0", 10.29).engine == 2.0
    assert lv.backend_view("b0", 10.31).stale
    # A request routed after the idle sample is credited on it until the next poll.
    lv.acquire("e0", 11.0)
    assert lv.backend_view("e0", 11.0).engine == 1.0
    # A sample taken while a request of ours was in flight to the group ages by the busy
    # interval, the other server's too.
    lv.publish("e0", EngineSample(0, 0, 11.05))
    lv.publish("b0", EngineSample(0, 0, 11.05))
    assert not lv.backend_view("e0", 11.34).stale
    assert not lv.backend_view("b0", 11.34).stale
    assert lv.backend_view("b0", 11.36).stale
    assert lv.backend_view("e0", 11.36).stale


def test_without_an_idle_interval_every_sample_ages_by_the_poll_interval() -> None:
    lv = view()
    lv.publish("e0", EngineSample(0, 0, 10.0))
    assert not lv.backend_view("e0", 10.29).stale
    assert lv.backend_view("e0", 10.31).stale
