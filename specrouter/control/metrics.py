"""Prometheus metrics of the router, in a registry of its own.

Two kinds of series, for cost reasons:
- events (requests, decisions, upstream errors, latencies) are counted as they happen;
  the label children are resolved once and cached, so the request path pays a dict
  lookup and an increment;
- state (in-flight, loads, health, breakers, telemetry age, policy version) is read
  from the router only when `/metrics` is scraped, through `LiveMetrics`, instead of
  updating gauges on every request.

Latency and status are observed by `MetricsMiddleware`, an ASGI wrapper around the app
that reads the `x-specrouter-pool` / `x-specrouter-backend` headers the proxy sets, so the
proxy itself knows nothing about metrics.

Several worker processes (`specrouter serve --workers N`) answer `/metrics` as one: a
scrape reaches one worker, so every worker keeps its series in prometheus_client's
multiprocess files (PROMETHEUS_MULTIPROC_DIR, a fresh directory per `serve`, set before
the workers start) and the worker that answers merges all of them:
- event metrics (Counter, Histogram, and any Gauge, which must name its multiprocess
  mode) write to the files as they change; counters and histograms are summed over all
  workers, dead ones included, so they never go backwards;
- scrape-time series (every Collector registered in `RouterMetrics.registry`) are copied
  into the files by each worker every `PUBLISH_INTERVAL_S` and by the answering worker at
  the scrape: counters are summed over all workers, gauges take the most recent live
  worker's value, except those in `SUMMED_GAUGES` (per-process counts), summed over the
  live workers; a series a worker no longer reports is dropped.
Files of dead workers' gauges are removed at each scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client import multiprocess as _multiprocess_module
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specrouter.routing.report import LiveMetrics
from specrouter.tasks import cancel_and_wait

PREFIX = "specrouter"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
BREAKER_STATES = ("closed", "open", "half_open")
#: Paths whose requests are counted and timed (the proxied generation routes and /v1/*).
_COUNTED_PREFIXES = ("/v1/", "/generate")
NO_LABEL = "none"
#: Where prometheus_client's multiprocess mode keeps each process's series.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: How often each worker copies its scrape-time series into its multiprocess files.
PUBLISH_INTERVAL_S = 1.0
#: Scrape-time gauges that count per process, so the workers' values add up.
SUMMED_GAUGES = frozenset({f"{PREFIX}_inflight_requests"})
#: prometheus_client's multiprocess module, untyped upstream.
_multiprocess: Any = _multiprocess_module
_WORKER_FILE = re.compile(r"_(\d+)\.db$")


class _LiveCollector(Collector):
    def __init__(self, source: Callable[[], LiveMetrics]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        live = self._source()
        inflight = GaugeMetricFamily(f"{PREFIX}_inflight_requests",
                                     "Requests the router has in flight, per backend",
                                     labels=["backend", "pool", "group"])
        healthy = GaugeMetricFamily(f"{PREFIX}_backend_healthy",
                                    "1 if the backend takes new requests", labels=["backend"])
        breaker = GaugeMetricFamily(f"{PREFIX}_breaker_state",
                                    "Circuit breaker state (1 for the current one)",
                                    labels=["backend", "state"])
        engine = GaugeMetricFamily(f"{PREFIX}_engine_load",
                                   "Credited engine load (running + waiting), fresh telemetry only",
                                   labels=["backend"])
        age = GaugeMetricFamily(f"{PREFIX}_telemetry_age_seconds",
                                "Age of the last telemetry sample", labels=["backend"])
        stale = CounterMetricFamily(f"{PREFIX}_telemetry_stale_reads",
                                    "Load reads that ignored stale telemetry", labels=["backend"])
        accept = GaugeMetricFamily(f"{PREFIX}_accept_length",
                                   "Live EAGLE accept length reported by the server",
                                   labels=["backend"])
        for b in live.backends:
            inflight.add_metric([b.name, b.pool, b.group], b.inflight)
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
            for state in BREAKER_STATES:
                breaker.add_metric([b.name, state], 1.0 if b.breaker == state else 0.0)
            if b.engine_load is not None:
                engine.add_metric([b.name], b.engine_load)
            if b.telemetry_age_s is not None:
                age.add_metric([b.name], b.telemetry_age_s)
            stale.add_metric([b.name], b.stale_reads)
            if b.accept_length is not None:
                accept.add_metric([b.name], b.accept_length)
        load = GaugeMetricFamily(f"{PREFIX}_group_load",
                                 "GPU group load under the policy's load signal", labels=["group"])
        for group, value in live.group_loads.items():
            load.add_metric([group], value)
        pool = GaugeMetricFamily(f"{PREFIX}_group_pool",
                                 "Pool new requests of the group go to (1 for the current one)",
                                 labels=["group", "pool"])
        for group, current in live.group_pools.items():
            for p in ("eagle", "baseline"):
                pool.add_metric([group, p], 1.0 if current == p else 0.0)
        version = GaugeMetricFamily(f"{PREFIX}_policy_version", "Version of the policy in force")
        version.add_metric([], live.policy_version)
        retention = GaugeMetricFamily(f"{PREFIX}_affinity_retention",
                                      "Share of the affinity index's prediction the backend's "
                                      "prefix cache held, from its reported cached tokens",
                                      labels=["backend"])
        for backend, share in live.cache_retention.items():
            retention.add_metric([backend], share)
        within = GaugeMetricFamily(f"{PREFIX}_affinity_tpot_within_share",
                                   "Share of the backend's recent streamed answers within the "
                                   "TPOT objective (affinity.tpot_slo_ms)", labels=["backend"])
        for backend, share in live.tpot_within_share.items():
            within.add_metric([backend], share)
        yield from (inflight, healthy, breaker, engine, age, stale, accept, load, pool, version,
                    retention, within)
        yield from _learned_families(live)


def _learned_families(live: LiveMetrics) -> Iterable[Metric]:
    """Each group's sustained load and online cost model (routing/online.py)."""
    sustained = GaugeMetricFamily(f"{PREFIX}_group_sustained_load",
                                  "Time-weighted average load of the group", labels=["group"])
    crossover = GaugeMetricFamily(f"{PREFIX}_learned_crossover",
                                  "Load where the learned model puts the baseline ahead",
                                  labels=["group"])
    step = GaugeMetricFamily(f"{PREFIX}_learned_step_ms",
                             "Learned decode step time at a batch size", labels=["group", "pool",
                                                                                "batch"])
    prior = GaugeMetricFamily(f"{PREFIX}_learned_prior_share",
                              "Share of the learned curve still resting on the prior",
                              labels=["group", "pool"])
    probes = CounterMetricFamily(f"{PREFIX}_cost_probes",
                                 "Cost probes of a pool's decode step, by outcome",
                                 labels=["group", "pool", "outcome"])
    for group, g in live.group_learned.items():
        if g.sustained_load is not None:
            sustained.add_metric([group], g.sustained_load)
        if g.crossover is not None:
            crossover.add_metric([group], g.crossover)
        for p, by_batch in g.step_ms.items():
            for batch, ms in by_batch.items():
                step.add_metric([group, p, str(batch)], ms)
        for p, share in g.prior_share.items():
            prior.add_metric([group, p], share)
        for (p, outcome), n in g.probes.items():
            probes.add_metric([group, p, outcome], n)
    yield from (sustained, crossover, step, prior, probes)


class RouterMetrics:
    """The router's series; `render()` is the `/metrics` body."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else _Registry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests answered, by pool/backend/status",
                                ["pool", "backend", "status"], registry=r)
        # `group` is last so that a line of the exposition still starts with the pool
        # (scripts/router_sweep.py matches that prefix); groups come from the configuration,
        # so the label's values are bounded.
        self.decisions = Counter(f"{PREFIX}_decisions",
                                 "Routing decisions, by pool, reason and GPU group",
                                 ["pool", "reason", "group"], registry=r)
        self.upstream_errors = Counter(f"{PREFIX}_upstream_errors",
                                       "Failed upstream exchanges (connection errors, 5xx)",
                                       ["backend"], registry=r)
        self.probes = Counter(f"{PREFIX}_probes", "Shadow accept-length probes sent, by backend",
                              ["backend"], registry=r)
        self.recalls = Counter(f"{PREFIX}_recalls",
                               "EAGLE-3 streams recalled before their first byte and sent "
                               "to the baseline pool, by group", ["group"], registry=r)
        self.handovers = Counter(f"{PREFIX}_handovers",
                                 "EAGLE-3 streams handed over after their first byte and "
                                 "continued on another backend, by group", ["group"],
                                 registry=r)
        self.affinity = Counter(f"{PREFIX}_affinity", "Requests with a prompt prefix or "
                                "session key, by whether they went to a backend believed to "
                                "hold part of it (hit) or not (miss)", ["result"], registry=r)
        self.callback_fallbacks = Counter(
            f"{PREFIX}_callback_fallbacks", "Generation requests the callback path was offered "
            "and handed to the ASGI app, by reason (docs/router.md, The callback path)",
            ["reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time to the first streamed byte of a response, per pool",
                              ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Request latency from arrival to the last byte, per pool",
                             ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self._children: dict[tuple[Any, ...], Any] = {}
        self._live: _LiveCollector | None = None
        self._shared = _SharedFiles.of_this_process(self.registry)

    @property
    def multiprocess(self) -> bool:
        """True when this process's series live in multiprocess files shared by workers."""
        return self._shared is not None

    def attach(self, source: Callable[[], LiveMetrics]) -> None:
        """Report `source()` at every scrape (one source; a second replaces the first)."""
        if self._live is not None:
            self.registry.unregister(self._live)
        self._live = _LiveCollector(source)
        self.registry.register(self._live)

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_decision(self, pool: str, reason: str, group: str) -> None:
        self._child(self.decisions, pool, reason, group).inc()

    def observe_probe(self, backend: str) -> None:
        self._child(self.probes, backend).inc()

    def observe_recall(self, group: str) -> None:
        self._child(self.recalls, group).inc()

    def observe_handover(self, group: str) -> None:
        self._child(self.handovers, group).inc()

    def observe_upstream_error(self, backend: str) -> None:
        self._child(self.upstream_errors, backend).inc()

    def observe_affinity(self, hit: bool) -> None:
        self._child(self.affinity, "hit" if hit else "miss").inc()

    def observe_fallback(self, reason: str) -> None:
        self._child(self.callback_fallbacks, reason).inc()

    def observe_request(self, pool: str, backend: str, status: int,
                        ttft_s: float | None, e2e_s: float) -> None:
        self._child(self.requests, pool, backend, str(status)).inc()
        if 200 <= status < 300:
            if ttft_s is not None:
                self._child(self.ttft, pool).observe(ttft_s)
            self._child(self.e2e, pool).observe(e2e_s)

    def render(self) -> bytes:
        if self._shared is None:
            return generate_latest(self.registry)
        return self._shared.render()

    async def publish_forever(self, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        """Copy this worker's scrape-time series into its files until cancelled (a
        scrape answered by another worker reads them there); no-op in one process."""
        if self._shared is None:
            return
        try:
            while True:
                self._shared.publish()
                await asyncio.sleep(interval_s)
        finally:
            self._shared.close()


class _Registry(CollectorRegistry):
    """A registry that keeps apart the collectors computed at scrape time (everything but
    prometheus_client's metric objects, which multiprocess mode already keeps in files)."""

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.computed.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        if collector in self.computed:
            self.computed.remove(collector)


class _SharedFiles:
    """This worker's part of the multiprocess files, and the merged view of all workers."""

    def __init__(self, path: str, registry: _Registry) -> None:
        self._path = path
        self._registry = registry
        self._value_class = values.ValueClass  # this process's mmap-backed value store
        self._values: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], Any] = {}

    @classmethod
    def of_this_process(cls, registry: CollectorRegistry) -> _SharedFiles | None:
        # prometheus_client picks its value store when first imported: the mmap-backed one
        # only if PROMETHEUS_MULTIPROC_DIR was set by then (`serve` sets it for workers).
        path = os.environ.get(MULTIPROC_ENV)
        if not path or not getattr(values.ValueClass, "_multiprocess", False):
            return None
        if not isinstance(registry, _Registry):
            raise TypeError("multiprocess metrics need RouterMetrics' own registry")
        return cls(path, registry)

    def publish(self, now: float | None = None) -> None:
        """Write every scrape-time sample of this worker; a gauge sample it no longer
        reports is overwritten with NaN, which the merged view drops."""
        stamp = time.time() if now is None else now
        seen = set()
        for collector in list(self._registry.computed):
            for family in collector.collect():
                counter = family.type == "counter"
                typ = "counter" if counter else "gauge"
                mode = ("" if counter else
                        "livesum" if family.name in SUMMED_GAUGES else "livemostrecent")
                for sample in family.samples:
                    labels = tuple(sorted(sample.labels.items()))
                    key = (typ, family.name, sample.name, labels)
                    value = self._values.get(key)
                    if value is None:
                        value = self._values[key] = self._value_class(
                            typ, family.name, sample.name, [k for k, _ in labels],
                            [v for _, v in labels], family.documentation,
                            multiprocess_mode=mode)
                    value.set(sample.value, timestamp=stamp)
                    seen.add(key)
        for key, value in self._values.items():
            if key not in seen and key[0] == "gauge":
                value.set(math.nan, timestamp=stamp)

    def render(self) -> bytes:
        self.publish()
        self.forget_dead_workers()
        registry = CollectorRegistry()
        registry.register(_Merged(self._path))
        return generate_latest(registry)

    def forget_dead_workers(self) -> None:
        """Remove the live-gauge files of workers that exited (uvicorn restarts a worker
        that dies, under a new pid); their counters stay, so sums never go backwards."""
        for pid in {int(m.group(1)) for f in glob.glob(os.path.join(self._path, "gauge_live*"))
                    if (m := _WORKER_FILE.search(f))}:
            if not _alive(pid):
                _multiprocess.mark_process_dead(pid, self._path)

    def close(self) -> None:
        """This worker stops: its live gauges leave the merged view."""
        _multiprocess.mark_process_dead(os.getpid(), self._path)


class _Merged(Collector):
    def __init__(self, path: str) -> None:
        self._merged = _multiprocess.MultiProcessCollector(None, path=path)

    def collect(self) -> Iterable[Metric]:
        for metric in self._merged.collect():
            metric.samples = [s for s in metric.samples if not math.isnan(s.value)]
            yield metric


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def shared_metrics_dir() -> Iterator[str]:
    """A fresh PROMETHEUS_MULTIPROC_DIR for the worker processes about to start, inside the
    one the operator gave if any (files of an earlier run would be summed in otherwise);
    removed when they have stopped."""
    base = os.environ.get(MULTIPROC_ENV) or None
    path = tempfile.mkdtemp(prefix="specrouter-metrics-", dir=base)
    previous = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def metrics_route(metrics: RouterMetrics, path: str = "/metrics") -> Route:
    async def endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Route(path, endpoint, methods=["GET"])


class MetricsMiddleware:
    """Times and counts each proxied request by the pool and backend the proxy chose."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.app = app
        self._metrics = metrics
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self._metrics.multiprocess:
            # The worker publishes its scrape-time series for as long as it serves.
            publisher = asyncio.ensure_future(self._metrics.publish_forever())
            try:
                await self.app(scope, receive, send)
            finally:
                await cancel_and_wait([publisher])
            return
        if scope["type"] != "http" or not scope["path"].startswith(_COUNTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        started = self._clock()
        seen = _Seen()

        async def timed_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                seen.start(message)
            elif kind == "http.response.body":
                if seen.streaming and seen.ttft is None and message.get("body"):
                    seen.ttft = self._clock() - started
                if not message.get("more_body", False) and not seen.done:
                    seen.done = True
                    self._metrics.observe_request(seen.pool, seen.backend, seen.status,
                                                  seen.ttft, self._clock() - started)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            if seen.status and not seen.done:  # the client left mid-response
                seen.done = True
                self._metrics.observe_request(seen.pool, seen.backend, 499, None,
                                              self._clock() - started)


class _Seen:
    __slots__ = ("backend", "done", "pool", "status", "streaming", "ttft")

    def __init__(self) -> None:
        self.pool = self.backend = NO_LABEL
        self.status = 0
        self.streaming = False
        self.ttft: float | None = None
        self.done = False

    def start(self, message: Message) -> None:
        self.status = int(message["status"])
        # The proxy appends its own headers last: scan from the end.
        for key, value in reversed(message.get("headers", [])):
            if key == b"x-specrouter-pool":
                self.pool = value.decode("latin-1")
            elif key == b"x-specrouter-backend":
                self.backend = value.decode("latin-1")
            elif key == b"content-type":
                self.streaming = value.startswith(b"text/event-stream")
