"""Telemetry of each backend's engine: parsers of SGLang's load endpoints, and a poller.

Shapes read from SGLang's sources (0.5.10 and 0.5.23; docs/policy.md section 7 has the files):
- GET /v1/loads: 0.5.23 {"timestamp" (ISO, server clock), "version", "accelerator",
  "num_accelerators", "loads":[{"dp_rank","timestamp" (float, server clock when the
  snapshot was built),"num_running_reqs","num_waiting_reqs",...,"speculative":{...}}]};
  0.5.10 {"timestamp","version","dp_rank_count","loads":[...],"aggregate":{...}}, no
  per-rank timestamp. `speculative.accept_length` is a LIFETIME mean in both. Each rank's
  `gen_throughput` is the scheduler's `last_gen_throughput` of its latest decode log.
  0.5.23 answers "loads": [] when its snapshot reader is not attached: no data.
- GET /get_load (0.5.3 to 0.5.10): [{"dp_rank","num_reqs","num_waiting_reqs","num_tokens"}]
  where num_reqs = running + waiting
- GET /metrics (--enable-metrics): gauges sglang:num_running_reqs, sglang:num_queue_reqs,
  sglang:spec_accept_length (mean of the last 40 decode batches: the only windowed accept
  length SGLang exposes), sglang:gen_throughput (set at the same decode log, every 40
  decode batches), one series per tp/pp/moe_ep/dp rank; with priority scheduling
  the total under priority="" plus one series per priority
- GET /server_info: internal_states[].avg_spec_accept_length, a lifetime mean

The parsers are pure; only `TelemetryPoller` does I/O.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from specrouter.backends import Backend
from specrouter.observe.fetch import Answer, TelemetryFetcher
from specrouter.observe.gauge_text import gauge_samples
from specrouter.observe.loadview import EngineSample
from specrouter.observe.local_errors import LocalFailure, RateLimitedLog, local_resource_error
from specrouter.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SOURCES = ("v1_loads", "get_load", "metrics")
PATHS = {
    "v1_loads": "/v1/loads?include=core,spec",
    "get_load": "/get_load",
    "metrics": "/metrics",
}


def _endpoint(source: str) -> str:
    """`source`'s path without its query, for the log."""
    return PATHS[source].partition("?")[0]


class TelemetryParseError(ValueError):
    """The payload does not have the shape SGLang sends, or carries no data."""


def _int(d: dict[str, Any], key: str, where: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TelemetryParseError(f"{where}: {key!r} missing or not a number")
    return int(v)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _accept_mean(values: list[float]) -> float | None:
    vals = [v for v in values if v > 0]
    return sum(vals) / len(vals) if vals else None


def parse_v1_loads(payload: Any, received_at: float) -> EngineSample:
    """Sum over DP ranks. The accept length it carries is SGLang's lifetime mean: kept as
    `accept_lifetime`, never as the windowed `accept_length`."""
    if not isinstance(payload, dict) or not isinstance(payload.get("loads"), list):
        raise TelemetryParseError("/v1/loads: expected an object with a 'loads' list")
    if not payload["loads"]:
        raise TelemetryParseError("/v1/loads: 'loads' is empty (no snapshot to read): no data")
    running = waiting = 0
    max_running: int | None = None
    kv_tokens: int | None = None
    kv_used: int | None = None
    lifetime: list[float] = []
    taken: list[float | None] = []
    throughput: list[float] = []
    for i, load in enumerate(payload["loads"]):
        if not isinstance(load, dict):
            raise TelemetryParseError(f"/v1/loads: loads[{i}] is not an object")
        running += _int(load, "num_running_reqs", f"/v1/loads loads[{i}]")
        waiting += _int(load, "num_waiting_reqs", f"/v1/loads loads[{i}]")
        taken.append(_number(load.get("timestamp")))
        if isinstance(load.get("max_running_requests"), int):
            max_running = (max_running or 0) + load["max_running_requests"]
        if isinstance(load.get("max_total_num_tokens"), int):
            kv_tokens = (kv_tokens or 0) + load["max_total_num_tokens"]
        if isinstance(load.get("num_used_tokens"), int):
            kv_used = (kv_used or 0) + load["num_used_tokens"]
        spec = load.get("speculative")
        accept = _number(spec.get("accept_length")) if isinstance(spec, dict) else None
        if accept is not None:
            lifetime.append(accept)
        rate = _number(load.get("gen_throughput"))
        if rate is not None:
            throughput.append(rate)
    ts = payload.get("timestamp")
    return EngineSample(running, waiting, received_at, None, "v1_loads", max_running,
                        ts if isinstance(ts, str) else None,
                        snapshot_age=snapshot_age(ts, taken),
                        accept_lifetime=_accept_mean(lifetime),
                        gen_throughput=sum(throughput) if throughput else None,
                        kv_tokens=kv_tokens, kv_used=kv_used)


def snapshot_age(answered: Any, taken: Sequence[float | None]) -> float | None:
    """Seconds between the oldest rank's snapshot and the answer, both on the engine's
    clock (0.5.23: per-rank `timestamp` against the answer's ISO `timestamp`); None when
    either is missing. Never compared with the router's clock, which may be offset."""
    if not isinstance(answered, str) or not taken or any(t is None for t in taken):
        return None
    try:
        at = datetime.datetime.fromisoformat(answered)
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    oldest = min(t for t in taken if t is not None)
    return max(0.0, at.timestamp() - oldest)


def parse_get_load(payload: Any, received_at: float) -> EngineSample:
    if not isinstance(payload, list):
        raise TelemetryParseError("/get_load: expected a list of per-rank objects")
    running = waiting = 0
    for i, load in enumerate(payload):
        if not isinstance(load, dict):
            raise TelemetryParseError(f"/get_load: item {i} is not an object")
        total = _int(load, "num_reqs", f"/get_load[{i}]")
        queued = _int(load, "num_waiting_reqs", f"/get_load[{i}]")
        running += max(0, total - queued)
        waiting += queued
    return EngineSample(running, waiting, received_at, None, "get_load")


#: Ranks of one batch: every tp/pp/moe_ep copy reports the same count (DP ranks add up).
_RANK_COPIES = frozenset({"tp_rank", "pp_rank", "moe_ep_rank"})
_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:spec_accept_length",
           "sglang:gen_throughput")

_SeriesKey = tuple[tuple[str, str], ...]


def _series_key(labels: dict[str, str]) -> _SeriesKey | None:
    """The batch a series describes, or None for a per-priority breakdown (SGLang writes
    the total under priority="" and each priority's share beside it)."""
    if labels.get("priority", "") != "":
        return None
    return tuple(sorted((k, v) for k, v in labels.items()
                        if k not in _RANK_COPIES and k != "priority"))


def _metric_gauges(text: str) -> dict[str, dict[_SeriesKey, float]]:
    """Per gauge of `_GAUGES`, one value per batch (rank copies merged by max). Only the
    lines of `_GAUGES` are read (`gauge_samples`): SGLang's /metrics carries dozens of
    families the router never reads."""
    gauges: dict[str, dict[_SeriesKey, float]] = {name: {} for name in _GAUGES}
    try:
        for name, labels, value in gauge_samples(text, _GAUGES):
            key = _series_key(labels)
            if key is not None:
                per_batch = gauges[name]
                per_batch[key] = max(per_batch.get(key, value), value)
    except ValueError as exc:
        raise TelemetryParseError(f"/metrics: not Prometheus text ({exc})") from None
    return gauges


def parse_metrics(text: str, received_at: float) -> EngineSample:
    """Prometheus text: running and queued requests summed over batches, and the windowed
    accept length (mean over DP ranks) with the window's identity (the gauge changes only
    when SGLang folds in 40 new decode batches)."""
    gauges = _metric_gauges(text)
    running, queued, accept, rate = (gauges[name] for name in _GAUGES)
    if not running:
        raise TelemetryParseError("/metrics: no sglang:num_running_reqs gauge")
    window = tuple(v for _, v in sorted(accept.items()))
    mean = _accept_mean(list(window))
    return EngineSample(int(sum(running.values())), int(sum(queued.values())), received_at,
                        mean, "metrics", accept_window=window or None,
                        gen_throughput=sum(rate.values()) if rate else None)


def parse_server_info_accept(payload: Any) -> float | None:
    """The lifetime mean accept length in /server_info internal_states (mean over DP
    ranks): what a server has accepted since it started or last flushed its cache."""
    if not isinstance(payload, dict):
        raise TelemetryParseError("/server_info: expected an object")
    states = payload.get("internal_states")
    if not isinstance(states, list):
        return None
    vals = [float(s["avg_spec_accept_length"]) for s in states
            if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"), int | float)]
    return _accept_mean(vals)


def parse_source(source: str, response_text: str, received_at: float) -> EngineSample:
    """Dispatch by source name (one of SOURCES)."""
    if source == "metrics":
        return parse_metrics(response_text, received_at)
    try:
        payload = json.loads(response_text)
    except json.JSONDecodeError:
        raise TelemetryParseError(f"{source}: body is not JSON") from None
    if source == "v1_loads":
        return parse_v1_loads(payload, received_at)
    if source == "get_load":
        return parse_get_load(payload, received_at)
    raise ValueError(f"unknown telemetry source {source!r}")


# --- poller -------------------------------------------------------------------------------


NO_WINDOWED_ACCEPT = (
    "the router reads no windowed accept length from it: /v1/loads and /server_info carry "
    "only SGLang's lifetime mean, which does not follow the workload, so the accept length "
    "counts as unknown and the goodput strategy uses its cost model's nominal accept length "
    "(start SGLang with --enable-metrics for the sglang:spec_accept_length gauge)")


#: After this many polls in a row in which no load endpoint answered, a backend is
#: searched only every SEARCH_INTERVAL_S: a server that is down, or an engine that serves
#: none of SGLang's load endpoints, would otherwise get three requests every poll.
SEARCH_MISSES = 10
SEARCH_INTERVAL_S = 1.0


@dataclass
class _PollState:
    source: str | None = None  # the endpoint that answered last
    polls: int = 0
    misses: int = 0  # polls in a row in which no load endpoint answered
    # where the windowed accept length comes from ("metrics"), or why it does not
    accept: str | None = None
    accept_missing_logged: bool = False
    idle: bool = False  # the last sample found the engine without a request


@dataclass
class TelemetryPoller:
    """Polls every backend each `interval` seconds and hands samples to `publish`.

    For each backend it tries /v1/loads, /get_load, /metrics in order and sticks to the
    first that answers with a parsable body; on a later failure it searches again.
    An EAGLE-3 backend whose load source is not /metrics gets /metrics read every
    `accept_every` polls for the windowed accept length (`publish_accept`); without it
    (SGLang started without --enable-metrics) the accept length is unknown, said once
    in the log and in `accept_status`. A failed poll publishes nothing: the load view
    then ages the last sample out (staleness) instead of trusting zeros. A poll that
    fails for the router's own lack of resources changes nothing (`LocalFailure`).

    After SEARCH_MISSES polls in a row without any answer, the backend is searched every
    SEARCH_INTERVAL_S (if that is longer than `interval`) until one answers, said once in
    the log each way.

    A backend whose last sample found its engine idle is polled every `idle_interval`
    unless `busy(name)` (the router's requests in flight to its group) says otherwise at
    the poll; `wake(name)`, called as a request is routed to its group, ends that wait, so
    the next poll comes within one interval of the last.

    `publish(name, sample)` and `publish_accept(name, sample)` are usually
    `LoadView.publish` and `LoadView.publish_accept`.
    """

    backends: Sequence[Backend]
    publish: Callable[[str, EngineSample], None]
    publish_accept: Callable[[str, EngineSample], None] | None = None
    # called as each poll is sent, with the clock (LoadView.poll_started: the credit rule
    # needs the in-flight count at the moment the engine took its snapshot)
    poll_started: Callable[[str, float], None] | None = None
    interval: float = 0.1
    # an idle backend's poll interval (None: `interval`), and whether the router has
    # requests in flight to a backend's group (None: never)
    idle_interval: float | None = None
    busy: Callable[[str], bool] | None = None
    timeout: float = 2.0
    accept_every: int = 5
    # None: the native keep-alive client (`observe.fetch`); an httpx client for tests
    client: httpx.AsyncClient | None = None
    clock: Callable[[], float] = time.monotonic
    _states: dict[str, _PollState] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _wakes: dict[str, asyncio.Event] = field(default_factory=dict)
    _fetcher: TelemetryFetcher | None = None
    _local_log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))

    def __post_init__(self) -> None:
        if self.interval <= 0 or (self.idle_interval is not None and self.idle_interval <= 0):
            raise ValueError("interval and idle_interval must be positive")
        if self.accept_every < 1:
            raise ValueError("accept_every must be at least 1")
        self._states = {b.name: _PollState() for b in self.backends}

    def source_of(self, name: str) -> str | None:
        """The endpoint that worked last for `name` (None before the first success)."""
        return self._states[name].source

    def delay(self, name: str) -> float:
        """The seconds from one poll of `name` to the next: `interval`; `idle_interval`
        while its last sample found it idle and it is not `busy`; SEARCH_INTERVAL_S while
        no load endpoint of it answers (`SEARCH_MISSES`). Never below `interval`."""
        st = self._states[name]
        if st.misses >= SEARCH_MISSES:
            return max(self.interval, SEARCH_INTERVAL_S)
        if st.idle and self.idle_interval is not None and not (
                self.busy is not None and self.busy(name)):
            return max(self.interval, self.idle_interval)
        return self.interval

    def accept_status(self, name: str) -> str | None:
        """"metrics" when `name`'s windowed accept length is read, else why it is not
        (None: not tried yet)."""
        return self._states[name].accept

    async def start(self) -> None:
        """Start one polling loop per backend (a hung one must not delay the others)."""
        if self._tasks:
            return
        self._wakes = {b.name: asyncio.Event() for b in self.backends}  # on this loop
        self._tasks = [asyncio.create_task(self._run(b), name=f"telemetry-{b.name}")
                       for b in self.backends]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._fetcher is not None:
            await self._fetcher.aclose()
            self._fetcher = None

    async def __aenter__(self) -> TelemetryPoller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self, backend: Backend) -> None:
        while True:
            started = self.clock()
            try:
                await self.poll_once(backend)
            except Exception:  # a bug in one poll must not end telemetry for good
                log.exception("telemetry poll of %s failed", backend.name)
            await self._until_due(backend.name, started)

    def wake(self, name: str) -> None:
        """A request is routed to `name`: its wait for the next poll is read again."""
        wake = self._wakes.get(name)
        if wake is not None:
            wake.set()

    async def _until_due(self, name: str, started: float) -> None:
        """Sleep until `delay(name)` has passed since `started`; a `wake` reads the delay
        again, so a backend that turned busy is polled within one interval."""
        wake = self._wakes[name]
        wake.clear()
        while (left := self.delay(name) - (self.clock() - started)) > 0:
            try:
                async with asyncio.timeout(left):
                    await wake.wait()
            except TimeoutError:
                return
            wake.clear()

    async def poll_once(self, backend: Backend) -> EngineSample | None:
        """One poll of one backend; never raises for network or payload trouble."""
        st = self._states[backend.name]
        st.polls += 1
        if self.poll_started is not None:
            self.poll_started(backend.name, self.clock())
        try:
            return await self._poll_sources(backend, st)
        except LocalFailure as exc:
            self._local_log.warning(
                backend.name, "telemetry poll of %s failed on the router's side (%s): "
                "the backend keeps its last state", backend.name, exc)
            return None

    async def _poll_sources(self, backend: Backend, st: _PollState) -> EngineSample | None:
        order = [st.source] if st.source else []
        order += [s for s in SOURCES if s not in order]
        for source in order:
            sample = await self._try(backend, source)
            if sample is not None:
                st.source, st.idle = source, sample.total == 0
                self._answered(backend, st, source)
                self.publish(backend.name, sample)
                if backend.pool == "eagle":
                    await self._windowed_accept(backend, st, sample)
                return sample
        st.source = None
        st.misses += 1
        if st.misses == SEARCH_MISSES and self._searches_slower:
            log.warning("backend %s answered none of %s in %d polls: the router counts its own "
                        "requests to it as its load, and looks again every %g s",
                        backend.name, ", ".join(_endpoint(s) for s in SOURCES),
                        st.misses, self.delay(backend.name))
        return None

    @property
    def _searches_slower(self) -> bool:
        """Whether a backend that answers none of the sources is polled less often."""
        return self.interval < SEARCH_INTERVAL_S

    def _answered(self, backend: Backend, st: _PollState, source: str) -> None:
        """Says in the log when a backend searched at the slower pace answers again (an
        idle backend's longer interval is no search, and says nothing)."""
        if st.misses >= SEARCH_MISSES and self._searches_slower:
            log.info("backend %s: its load is read from %s again", backend.name,
                     _endpoint(source))
        st.misses = 0

    async def _get(self, backend: Backend, path: str) -> Answer | httpx.Response | None:
        """The answer, None when the backend did not give one, or LocalFailure. Without
        an httpx client passed in, the native transport fetches (`observe.fetch`)."""
        if self.client is None:
            if self._fetcher is None:
                self._fetcher = TelemetryFetcher(self.timeout)
            return await self._fetcher.get(backend, path)
        headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
        try:
            return await self.client.get(backend.url.rstrip("/") + path, headers=headers,
                                         timeout=self.timeout)
        except (httpx.HTTPError, OSError) as exc:
            local = local_resource_error(exc)
            if local is not None:
                raise LocalFailure(f"{path}: {local}") from exc
            return None

    async def _try(self, backend: Backend, source: str) -> EngineSample | None:
        resp = await self._get(backend, PATHS[source])
        if resp is None or resp.status_code != 200:
            return None
        try:
            return parse_source(source, resp.text, self.clock())
        except TelemetryParseError:
            return None

    async def _windowed_accept(self, backend: Backend, st: _PollState,
                               sample: EngineSample) -> None:
        if sample.accept_window is not None:
            self._accept_found(backend, st)  # the load source is /metrics itself
            return
        if self.publish_accept is None or (st.polls - 1) % self.accept_every:
            return
        resp = await self._get(backend, PATHS["metrics"])
        if resp is None:
            return  # no answer: the next read tells
        if resp.status_code != 200:
            self._accept_missing(backend, st, f"/metrics answers HTTP {resp.status_code}")
            return
        try:
            reading = parse_metrics(resp.text, self.clock())
        except TelemetryParseError as exc:
            self._accept_missing(backend, st, str(exc))
            return
        if reading.accept_window is None:
            self._accept_missing(backend, st, "/metrics has no sglang:spec_accept_length")
            return
        self._accept_found(backend, st)
        self.publish_accept(backend.name, reading)

    def _accept_found(self, backend: Backend, st: _PollState) -> None:
        if st.accept_missing_logged:
            log.info("backend %s: the windowed accept length is read from /metrics again",
                     backend.name)
        st.accept, st.accept_missing_logged = "metrics", False

    def _accept_missing(self, backend: Backend, st: _PollState, why: str) -> None:
        st.accept = f"none: {why}"
        if not st.accept_missing_logged:
            st.accept_missing_logged = True
            log.warning("backend %s: %s; %s", backend.name, why, NO_WINDOWED_ACCEPT)
