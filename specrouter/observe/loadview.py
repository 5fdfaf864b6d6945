"""Per-backend and per-group load, from the router's own counts and engine telemetry.

Pure data and arithmetic, no I/O and no clock: every read takes `now` (monotonic
seconds) so tests and the request path decide what time it is.

Two sources, each wrong in its own way:
- the router's in-flight count is exact and instant, but blind to work that other
  clients (or other router replicas not summed in) sent to the engine;
- the engine's running + waiting count sees everything, but lags: it arrives once
  per poll, and SGLang itself refreshes it only every N decode steps.

The credit rule joins them without double counting (see `BackendLoad.engine_load`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from specrouter.backends import POOLS, Pool

LoadSignal = Literal["inflight", "engine", "max"]

#: A poll answer older than this many poll intervals is ignored.
STALE_AFTER_INTERVALS = 3.0
#: A load snapshot the engine built longer ago than this is ignored however fresh the
#: answer that carried it: SGLang 0.5.23 republishes it at every prefill batch, every 15
#: decode batches and while idle, so an older one means a scheduler stuck in one batch.
SNAPSHOT_MAX_AGE_S = 2.0
#: The windowed accept length moves with the workload over seconds: a reading stays
#: usable this long.
ACCEPT_MAX_AGE_S = 30.0
#: How far back the in-flight history reaches (beyond SNAPSHOT_MAX_AGE_S plus a poll).
HISTORY_S = 5.0
#: A cached snapshot is rebuilt this long before a deadline it depends on (see
#: `BackendLoad.view_changes_at`).
_DEADLINE_MARGIN_S = 1e-6

_new, _set = object.__new__, object.__setattr__


@dataclass(frozen=True)
class EngineSample:
    """One telemetry reading of one SGLang server.

    `received_at` is the router's monotonic clock when the answer arrived. The engine's
    wall clock is only compared with itself: `snapshot_age` is how old the engine's load
    snapshot was when the engine built the answer (SGLang 0.5.23's per-rank `timestamp`
    against the answer's own `timestamp`; None where the source does not tell).
    `accept_length` is a windowed mean (the /metrics gauge over the last 40 decode
    batches), never the lifetime mean of /v1/loads or /server_info, which is kept apart
    in `accept_lifetime` for display: it does not move with the workload.
    """

    running: int
    waiting: int
    received_at: float
    accept_length: float | None = None
    source: str = ""
    max_running: int | None = None
    engine_timestamp: str | None = None
    # What identifies the engine's accept window behind this reading (SGLang refreshes the
    # gauge every 40 decode batches, the router polls faster): equal keys, same steps.
    # None: the source cannot tell its windows apart.
    accept_window: tuple[float, ...] | None = None
    snapshot_age: float | None = None
    accept_lifetime: float | None = None
    # SGLang's `gen_throughput` (tokens/s, summed over DP ranks): the tokens of its last
    # 40 decode batches over the wall time since the decode log before them, so prefill
    # batches and the other engine's GPU time slices in between are in it. Equal values
    # are the same window. None: the source does not carry it.
    gen_throughput: float | None = None
    # SGLang's `max_total_num_tokens` (summed over DP ranks): the KV pool in tokens, which
    # is also the most its prefix cache can hold. None: the source does not carry it.
    kv_tokens: int | None = None
    # SGLang's `num_used_tokens` (summed over DP ranks): KV tokens the running requests
    # hold (locked prefixes and what they computed beyond them), evictable cache excluded.
    # None: the source does not carry it.
    kv_used: int | None = None

    @property
    def total(self) -> int:
        return self.running + self.waiting

    @property
    def taken_at(self) -> float:
        """When the engine took its load snapshot, on the router's clock (the answer's
        transit time aside)."""
        return self.received_at - (self.snapshot_age or 0.0)


@dataclass(frozen=True)
class BackendView:
    """Immutable snapshot of one backend, handed to the pure policy."""

    name: str
    pool: Pool
    healthy: bool
    inflight: int
    engine: float | None  # credited engine load; None when telemetry is missing or stale
    telemetry_age: float | None
    stale: bool
    accept_length: float | None
    accept_seen_at: float | None  # received_at of the sample that carried accept_length
    # requests the server was running when it reported that accept length (None: not
    # known, e.g. read from /server_info): how many requests the reading averages over
    accept_batch: int | None = None
    accept_window: tuple[float, ...] | None = None  # EngineSample.accept_window of the reading

    def load(self, signal: LoadSignal) -> float:
        """The load under `signal`; without fresh telemetry every signal is in-flight."""
        if signal == "inflight" or self.engine is None:
            return float(self.inflight)
        if signal == "engine":
            return self.engine
        return max(float(self.inflight), self.engine)


@dataclass(frozen=True)
class GroupView:
    """Immutable snapshot of one GPU group: the unit the policy decides for.

    Its reads (`servers`, `healthy_servers`, `load`, `any_healthy`) depend only on the
    immutable fields, so each is computed once per view and handed out again (`_memo`).
    """

    name: str
    backends: tuple[BackendView, ...]
    # the group's sustained load (routing/learning.py); None where not tracked
    sustained: float | None = None
    _memo: dict[object, Any] = field(default_factory=dict, init=False, repr=False,
                                     compare=False, hash=False)

    def servers(self, pool: Pool) -> tuple[BackendView, ...]:
        key = ("servers", pool)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = tuple(b for b in self.backends if b.pool == pool)
        return found

    def healthy_servers(self, pool: Pool) -> tuple[BackendView, ...]:
        key = ("healthy", pool)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = tuple(b for b in self.servers(pool) if b.healthy)
        return found

    def pool_healthy(self, pool: Pool) -> bool:
        return bool(self.healthy_servers(pool))

    @property
    def any_healthy(self) -> bool:
        found = self._memo.get("any_healthy")
        if found is None:
            found = self._memo["any_healthy"] = any(b.healthy for b in self.backends)
        return found

    def load(self, signal: LoadSignal) -> float:
        """Sum over all the group's servers: they share one GPU, healthy or not."""
        found = self._memo.get(signal)
        if found is None:
            found = self._memo[signal] = sum(b.load(signal) for b in self.backends)
        return found

    def with_sustained(self, sustained: float | None) -> GroupView:
        """This view with `sustained`; the reads computed so far carry over (none of them
        reads `sustained`)."""
        return _group_view(self.name, self.backends, sustained, self._memo)

    def eagle_accept(self) -> tuple[float | None, float | None]:
        """(accept length, when it was received) of the freshest EAGLE server reading."""
        b = self._freshest_accept()
        return (None, None) if b is None else (b.accept_length, b.accept_seen_at)

    def eagle_accept_batch(self) -> int | None:
        """Requests behind the freshest EAGLE reading (None: not known)."""
        b = self._freshest_accept()
        return None if b is None else b.accept_batch

    def eagle_accept_window(self) -> tuple[float, ...] | None:
        """The engine's accept window behind the freshest EAGLE reading (None: not known)."""
        b = self._freshest_accept()
        return None if b is None else b.accept_window

    def _freshest_accept(self) -> BackendView | None:
        best: BackendView | None = None
        for b in self.servers("eagle"):
            if b.accept_length is None or b.accept_seen_at is None:
                continue
            if best is None or b.accept_seen_at > (best.accept_seen_at or float("-inf")):
                best = b
        return best


def _group_view(name: str, backends: tuple[BackendView, ...], sustained: float | None = None,
                memo: dict[object, Any] | None = None) -> GroupView:
    """`GroupView(name, backends, sustained)` (sharing `memo`), its fields set as the
    dataclass's `__init__` sets them less its `object.__setattr__` per field: a view is
    built at every count change and decision."""
    view = _new(GroupView)
    _set(view, "__dict__", {"name": name, "backends": backends, "sustained": sustained,
                            "_memo": {} if memo is None else memo})
    return view


def _recounted(view: BackendView, load: BackendLoad) -> BackendView:
    """`view` with `load`'s in-flight count now: a count changes neither staleness nor
    an accept reading's freshness, so only the count and the credited engine load move."""
    fields = dict(view.__dict__)
    fields["inflight"] = load.inflight
    if view.engine is not None:
        fields["engine"] = load.credited()
    new = _new(BackendView)
    _set(new, "__dict__", fields)
    return new


@dataclass
class InflightHistory:
    """The router's in-flight count of one backend over the last HISTORY_S seconds."""

    changes: deque[tuple[float, int]] = field(default_factory=deque)  # (time, count from then)
    before: int = 0  # the count before the oldest change kept

    def record(self, now: float, count: int) -> None:
        self.changes.append((now, count))
        while len(self.changes) > 1 and self.changes[1][0] <= now - HISTORY_S:
            self.before = self.changes.popleft()[1]

    def peak(self, start: float, end: float) -> int:
        """The highest count in force at any moment of [start, end]."""
        peak: int | None = None
        for t, count in reversed(self.changes):
            if t < start:
                return count if peak is None else max(peak, count)
            if t <= end:
                peak = count if peak is None else max(peak, count)
        return self.before if peak is None else max(peak, self.before)

    def busy_share(self, start: float, end: float) -> float:
        """The share of [start, end] with at least one request in flight (1.0 for an
        empty span with one in flight at `end`)."""
        spans = self._spans(start, end)
        total = sum(d for d, _ in spans)
        if total <= 0:
            return 1.0 if spans[-1][1] > 0 else 0.0
        return sum(d for d, c in spans if c > 0) / total

    def mean(self, start: float, end: float) -> float:
        """The time-weighted mean count over [start, end] (the count at `end` if empty)."""
        spans = self._spans(start, end)
        total = sum(d for d, _ in spans)
        if total <= 0:
            return float(spans[-1][1])
        return sum(d * c for d, c in spans) / total

    def _spans(self, start: float, end: float) -> list[tuple[float, int]]:
        """(duration, count) of each stretch of [start, end], oldest first; at least one.
        Before the oldest change kept the count is `before`. The changes are read from the
        newest back to the last one at or before `start`: a window of the last second
        costs its own changes, not the whole history's."""
        inside: list[tuple[float, int]] = []  # the changes after `start`, newest first
        count = self.before
        for t, c in reversed(self.changes):
            if t <= start:
                count = c
                break
            inside.append((t, c))
        spans: list[tuple[float, int]] = []
        t_prev = start
        for t, c in reversed(inside):
            if t > end:
                break
            spans.append((t - t_prev, count))
            t_prev, count = t, c
        spans.append((max(0.0, end - t_prev), count))
        return spans


@dataclass
class BackendLoad:
    """Mutable counters of one backend; owned by `LoadView`."""

    name: str
    group: str
    pool: Pool
    inflight: int = 0
    history: InflightHistory = field(default_factory=InflightHistory)
    sample: EngineSample | None = None
    inflight_at_sample: int = 0
    poll_sent_at: float | None = None  # when the poll now on the wire was sent
    accept_length: float | None = None
    accept_seen_at: float | None = None
    accept_batch: int | None = None
    accept_window: tuple[float, ...] | None = None
    accept_lifetime: float | None = None
    stale_reads: int = 0
    # the poll interval the sample is judged by when it found the engine idle with nothing
    # of the router's in flight to its group, and idle groups are polled more slowly
    # (None: the caller's interval)
    quiet_interval: float | None = None

    def engine_load(self, now: float, interval: float) -> float | None:
        """Credited engine load, or None when there is no fresh sample.

        Rule: telemetry + (in-flight now - in-flight when the engine took its snapshot),
        floored at 0. A request dispatched before the snapshot is counted in both the
        sample and `inflight_at_sample`, so the difference excludes it; one dispatched
        after is in neither, so the difference adds it; one finished after the snapshot
        is subtracted. Other clients' work stays in via the sample.
        The snapshot's moment is known up to the poll's round trip (shifted back by the
        snapshot's own age where the engine reports it), so `inflight_at_sample` is the
        highest count in force over that span: a request that ended after the snapshot
        is still in the engine's count and must not stay in the load as a phantom.
        Erring low instead only hides a request dispatched in that span from the engine
        part until the next poll, and the router's own in-flight count, exact, still
        counts it.
        """
        if self.sample is None or self.is_stale(now, interval):
            return None
        return self.credited()

    def credited(self) -> float:
        """The credit rule's load, whether or not the sample is fresh (one is required)."""
        assert self.sample is not None
        return max(0.0, float(self.sample.total + self.inflight - self.inflight_at_sample))

    def age(self, now: float) -> float | None:
        """Seconds since the engine took the snapshot behind the sample."""
        return None if self.sample is None else max(0.0, now - self.sample.taken_at)

    def _judged_by(self, interval: float) -> float:
        """The poll interval the sample ages by: an idle server's slower one, where its
        sample found it idle (no count change moves it: the next sample does)."""
        return interval if self.quiet_interval is None else max(interval, self.quiet_interval)

    def is_stale(self, now: float, interval: float) -> bool:
        age = self.age(now)
        if self.sample is None or age is None:
            return True
        interval = self._judged_by(interval)
        return (now - self.sample.received_at > STALE_AFTER_INTERVALS * interval
                or age > max(SNAPSHOT_MAX_AGE_S, STALE_AFTER_INTERVALS * interval))

    def view_changes_at(self, now: float, interval: float) -> float:
        """The latest moment up to which, with no new count or reading, a view of this
        backend built at `now` still reads the same (its telemetry age aside): before its
        sample goes stale and before its accept reading expires. A sample already stale
        stays stale until the next reading."""
        until = float("inf")
        if self.sample is not None and not self.is_stale(now, interval):
            interval = self._judged_by(interval)
            until = min(self.sample.received_at + STALE_AFTER_INTERVALS * interval,
                        self.sample.taken_at
                        + max(SNAPSHOT_MAX_AGE_S, STALE_AFTER_INTERVALS * interval))
        if self.accept_seen_at is not None and now - self.accept_seen_at <= ACCEPT_MAX_AGE_S:
            until = min(until, self.accept_seen_at + ACCEPT_MAX_AGE_S)
        # The comparisons above subtract, the deadline adds: one rounding apart, so the
        # deadline is brought forward by far more than a rounding error.
        return until - _DEADLINE_MARGIN_S

    def take_accept(self, sample: EngineSample) -> None:
        """Keep `sample`'s windowed accept length unless a newer reading is kept."""
        if sample.accept_length is None:
            return
        if self.accept_seen_at is not None and sample.received_at < self.accept_seen_at:
            return
        self.accept_length = sample.accept_length
        self.accept_seen_at = sample.received_at
        self.accept_batch = sample.running
        self.accept_window = sample.accept_window


@dataclass(slots=True)
class _Snapshot:
    """A built `LoadView.snapshot`, valid while no reading, health flag or backend has
    changed and no deadline of its readings has passed. A count change rebuilds only its
    backend's view and that backend's group (`LoadView._recount`)."""

    groups: tuple[GroupView, ...]
    views: dict[str, BackendView]  # each backend's view in `groups`
    version: int  # LoadView._version when built
    healthy: tuple[bool, ...]  # the health flags it was built with, in LoadView._order
    built_at: float
    until: float  # the earliest BackendLoad.view_changes_at of its backends
    stale: tuple[BackendLoad, ...]  # backends read stale: each read counts in stale_reads


@dataclass
class LoadView:
    """Loads of every backend, grouped by GPU group.

    The request path calls `acquire`/`release` around each upstream request and
    `snapshot`/`group_view` to decide; the telemetry poller calls `publish`.
    Not thread-safe: use it from one event loop.

    `snapshot` is built once and handed out again until a count, a reading or a health
    flag changes, or a deadline of its readings passes (a sample going stale, an accept
    reading expiring: `BackendLoad.view_changes_at`), so a request reads the same
    views a fresh build would give, except `BackendView.telemetry_age`, which is the
    age when the snapshot was built. A count change (acquire, release) changes neither
    a backend's staleness nor a deadline, so it rebuilds only the views of the backends
    whose count changed and of their groups; the rest are handed out again.
    """

    poll_interval: float = 0.1
    # how often a server is polled while its last sample found it idle and nothing of the
    # router's was in flight to its group (None: `poll_interval`, as any other)
    idle_poll_interval: float | None = None
    backends: dict[str, BackendLoad] = field(default_factory=dict)
    _version: int = field(default=0, init=False, repr=False, compare=False)
    _order: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    # each backend's position in _order (and in _Snapshot.healthy)
    _position: dict[str, int] = field(default_factory=dict, init=False, repr=False,
                                      compare=False)
    # each group's backends, groups and backends sorted by name (as `group_view` lists them)
    _members: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False,
                                                 compare=False)
    # each group's position in _members (and in a snapshot)
    _group_index: dict[str, int] = field(default_factory=dict, init=False, repr=False,
                                         compare=False)
    # each group's in-flight count: the sum over its backends, kept at every count change
    _group_inflight: dict[str, int] = field(default_factory=dict, init=False, repr=False,
                                            compare=False)
    # backends whose count changed since the cached snapshot was last brought up to date
    _counted: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _cache: _Snapshot | None = field(default=None, init=False, repr=False, compare=False)

    def add_backend(self, name: str, group: str, pool: Pool) -> None:
        if name in self.backends:
            raise ValueError(f"backend {name!r} is already registered")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.backends[name] = BackendLoad(name=name, group=group, pool=pool)
        self._order = tuple(sorted(self.backends))
        self._position = {n: i for i, n in enumerate(self._order)}
        self._members = {g: tuple(n for n in self._order if self.backends[n].group == g)
                         for g in self.group_names()}
        self._group_index = {g: i for i, g in enumerate(self._members)}
        self._group_inflight.setdefault(group, 0)
        self._version += 1

    def _get(self, name: str) -> BackendLoad:
        try:
            return self.backends[name]
        except KeyError:
            raise KeyError(f"unknown backend {name!r}") from None

    def acquire(self, name: str, now: float) -> None:
        """A request was admitted to backend `name` (call before sending it)."""
        b = self._get(name)
        b.inflight += 1
        b.history.record(now, b.inflight)
        self._group_inflight[b.group] += 1
        self._counted.add(name)

    def release(self, name: str, now: float) -> None:
        """A request to `name` ended (success, error or client disconnect)."""
        b = self._get(name)
        if b.inflight <= 0:
            raise RuntimeError(f"release without acquire on backend {name!r}")
        b.inflight -= 1
        b.history.record(now, b.inflight)
        self._group_inflight[b.group] -= 1
        self._counted.add(name)

    def members(self, group: str) -> tuple[str, ...]:
        """`group`'s backends, sorted by name."""
        return self._members[group]

    def group_inflight(self, group: str) -> int:
        """The in-flight count summed over `group`'s backends (0 for an unknown group)."""
        return self._group_inflight.get(group, 0)

    def poll_started(self, name: str, now: float) -> None:
        """A telemetry poll of `name` is being sent (see `BackendLoad.engine_load`)."""
        self._get(name).poll_sent_at = now

    def publish(self, name: str, sample: EngineSample) -> None:
        """Record a telemetry sample with the in-flight count its snapshot saw."""
        b = self._get(name)
        if b.sample is not None and sample.received_at < b.sample.received_at:
            return  # an answer overtaken by a newer one
        sent_at = sample.received_at if b.poll_sent_at is None else b.poll_sent_at
        shift = sample.snapshot_age or 0.0
        b.sample, b.poll_sent_at = sample, None
        b.inflight_at_sample = b.history.peak(sent_at - shift, sample.received_at - shift)
        b.quiet_interval = (self.idle_poll_interval if sample.total == 0
                            and b.inflight_at_sample == 0
                            and self._group_inflight[b.group] == 0 else None)
        b.take_accept(sample)
        if sample.accept_lifetime is not None:
            b.accept_lifetime = sample.accept_lifetime
        self._version += 1

    def publish_accept(self, name: str, sample: EngineSample) -> None:
        """The windowed accept length of a side-channel reading (/metrics next to a
        /v1/loads load source); its load counts are not used."""
        self._get(name).take_accept(sample)
        self._version += 1

    def backend_view(self, name: str, now: float, healthy: bool = True) -> BackendView:
        b = self._get(name)
        view = self._view_of(b, now, healthy)
        if view.stale and b.sample is not None:
            b.stale_reads += 1  # a read that fell back to in-flight: exported as a metric
        return view

    def _view_of(self, b: BackendLoad, now: float, healthy: bool) -> BackendView:
        """`b`'s view at `now`; a stale read is not counted here."""
        sample = b.sample
        stale = b.is_stale(now, self.poll_interval)
        engine = None if stale or sample is None else b.credited()
        seen = b.accept_seen_at
        fresh = seen is not None and now - seen <= ACCEPT_MAX_AGE_S
        # The fields set as the dataclass's `__init__` sets them, less its one
        # `object.__setattr__` per field (a third of the cost on the request path).
        view = _new(BackendView)
        _set(view, "__dict__", {
            "name": b.name, "pool": b.pool, "healthy": healthy, "inflight": b.inflight,
            "engine": engine,
            "telemetry_age": None if sample is None else max(0.0, now - sample.taken_at),
            "stale": stale, "accept_length": b.accept_length if fresh else None,
            "accept_seen_at": seen if fresh else None,
            "accept_batch": b.accept_batch if fresh else None,
            "accept_window": b.accept_window if fresh else None})
        return view

    def group_names(self) -> list[str]:
        return sorted({b.group for b in self.backends.values()})

    def group_view(
        self, group: str, now: float, healthy: Callable[[str], bool] = lambda _n: True
    ) -> GroupView:
        names = sorted(n for n, b in self.backends.items() if b.group == group)
        if not names:
            raise KeyError(f"unknown group {group!r}")
        return GroupView(group, tuple(self.backend_view(n, now, healthy(n)) for n in names))

    @property
    def order(self) -> tuple[str, ...]:
        """Every backend's name, in the order of `flagged_snapshot`'s health flags."""
        return self._order

    def snapshot(
        self, now: float, healthy: Callable[[str], bool] = lambda _n: True
    ) -> tuple[GroupView, ...]:
        """Every group's view, from the cache while it holds (see the class docstring)."""
        return self.flagged_snapshot(now, tuple(healthy(n) for n in self._order))

    def flagged_snapshot(self, now: float, flags: tuple[bool, ...]) -> tuple[GroupView, ...]:
        """`snapshot` with each backend's health given in `order`."""
        cached = self._cache
        if (cached is None or cached.version != self._version or cached.healthy != flags
                or not cached.built_at <= now <= cached.until):
            cached = self._build(now, flags)
        elif self._counted:
            self._recount(cached)
        for b in cached.stale:
            b.stale_reads += 1
        return cached.groups

    def _build(self, now: float, flags: tuple[bool, ...]) -> _Snapshot:
        view, loads = self._view_of, self.backends
        views = {n: view(loads[n], now, ok) for n, ok in zip(self._order, flags, strict=True)}
        groups = tuple(GroupView(g, tuple(views[n] for n in names))
                       for g, names in self._members.items())
        interval = self.poll_interval
        until = min((b.view_changes_at(now, interval) for b in loads.values()),
                    default=float("inf"))
        stale = tuple(b for b in loads.values()
                      if b.sample is not None and b.is_stale(now, interval))
        self._counted.clear()
        self._cache = _Snapshot(groups, views, self._version, flags, now, until, stale)
        return self._cache

    def _recount(self, cached: _Snapshot) -> None:
        """Bring `cached` up to date with the counts changed since: those backends' views
        take their new counts (`_recounted`) and their groups are rebuilt, every other
        view is kept."""
        views, loads, groups = cached.views, self.backends, list(cached.groups)
        touched = set()
        for name in self._counted:
            b = loads[name]
            views[name] = _recounted(views[name], b)
            touched.add(b.group)
        self._counted.clear()
        for g in touched:
            groups[self._group_index[g]] = _group_view(
                g, tuple(views[n] for n in self._members[g]))
        cached.groups = tuple(groups)

    def stale_reads(self) -> Mapping[str, int]:
        return {n: b.stale_reads for n, b in self.backends.items()}
