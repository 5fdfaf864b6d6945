"""/metrics in SGLang's Prometheus names and label sets, for one simulated engine.

Scheduler gauges carry `model_name, engine_type, tp_rank, pp_rank, moe_ep_rank` (+ `priority`
with priority scheduling; `dp_rank` only with data parallelism, which the simulator does not
run) (observability/metrics_collector.py 0.5.23:1382-1394; 0.5.10
scheduler_metrics_mixin.py:133-142). With priority scheduling the queue gauges
(`num_running_reqs`, `num_queue_reqs`) carry the total under `priority=""` AND one series per
priority (metrics_collector.py 0.5.23:1417-1429): a reader that sums every series counts twice.
Tokenizer counters and histograms carry `model_name` (0.5.10) or `model_name, engine_type`
(0.5.23), `priority=""` with priority scheduling, and on 0.5.23 `is_streaming` for the prompt,
generation and request counters and the TTFT and e2e histograms (metrics_collector.py
0.5.23:1804-1822,1855-2070). Those count a request when it finishes, as SGLang does.

Gauges come from the engine's last decode log (every 40 decode batches) or prefill/idle refresh,
not live; `sglang:spec_accept_length` is the mean of the last 40 decode batches. Latencies are
simulated seconds, so a run at --time-scale 0.1 reports what the same run at full scale would.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specrouter.sim.engine import Engine
from specrouter.sim.version import SglangVersion

SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TTFT_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)


class EngineMetrics(Collector):
    def __init__(self, engine: Engine, model_name: str, version: SglangVersion,
                 priority_scheduling: bool = False) -> None:
        self.engine = engine
        self.priority_scheduling = priority_scheduling
        tail = ("priority",) if priority_scheduling else ()
        self.labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0",
                       "pp_rank": "0", "moe_ep_rank": "0", **dict.fromkeys(tail, "")}
        self.scheduler_labels = (*SCHEDULER_LABELS, *tail)
        self.tokenizer_labels = (*version.tokenizer_labels, *tail)
        self.stream_split = version.is_streaming_label
        self._known_priorities: set[str] = set()  # a priority once seen keeps its series
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        streamed = (*self.tokenizer_labels, "is_streaming") if self.stream_split \
            else self.tokenizer_labels
        reg = self.registry
        self._prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                               streamed, registry=reg)
        self._generation = Counter("sglang:generation_tokens",
                                   "Number of generation tokens processed.", streamed,
                                   registry=reg)
        self._requests = Counter("sglang:num_requests", "Number of requests processed.",
                                 streamed, registry=reg)
        self._ttft = Histogram("sglang:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", streamed,
                               buckets=TTFT_BUCKETS, registry=reg)
        self._itl = Histogram("sglang:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.",
                              self.tokenizer_labels, buckets=ITL_BUCKETS, registry=reg)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds",
                              "Histogram of End-to-end request latency in seconds", streamed,
                              buckets=E2E_BUCKETS, registry=reg)

    def _tokenizer_values(self, stream: bool | None = None) -> list[str]:
        values = [self.labels[k] for k in self.tokenizer_labels]
        if stream is not None and self.stream_split:
            values.append("true" if stream else "false")
        return values

    def observe_finished(self, stream: bool, prompt_tokens: int, generation_tokens: int,
                         ttft_s: float, e2e_s: float, itl_s: float | None) -> None:
        labels = self._tokenizer_values(stream)
        self._prompt.labels(*labels).inc(prompt_tokens)
        self._generation.labels(*labels).inc(generation_tokens)
        self._requests.labels(*labels).inc()
        self._ttft.labels(*labels).observe(ttft_s)
        self._e2e.labels(*labels).observe(e2e_s)
        if itl_s is not None:
            self._itl.labels(*self._tokenizer_values()).observe(itl_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        e, g, c = self.engine, self.engine.gauges, self.engine.counters
        cap = e.limits.kv_capacity_tokens
        values = [self.labels[k] for k in self.scheduler_labels]
        yield self._queue_gauge("sglang:num_running_reqs", "The number of running requests.",
                                g.num_running_reqs, g.running_by_priority, values)
        yield self._queue_gauge("sglang:num_queue_reqs",
                                "The number of requests in the waiting queue.",
                                g.num_waiting_reqs, g.waiting_by_priority, values)
        gauges = [
            ("sglang:num_used_tokens", "The number of used tokens.", g.num_used_tokens),
            ("sglang:token_usage", "The token usage.", g.num_used_tokens / cap),
            ("sglang:gen_throughput", "The generation throughput (token/s).", g.gen_throughput),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", g.cache_hit_rate),
            ("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
             g.window_accept_length),
            ("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.",
             g.window_accept_rate),
            ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
             cap),
        ]
        for name, doc, value in gauges:
            fam = GaugeMetricFamily(name, doc, labels=self.scheduler_labels)
            fam.add_metric(values, float(value))
            yield fam
        aborted = CounterMetricFamily("sglang:num_aborted_requests",
                                      "Number of requests aborted.", labels=self.tokenizer_labels)
        aborted.add_metric(self._tokenizer_values(), float(c.aborted))
        yield aborted

    def _queue_gauge(self, name: str, doc: str, total: int, by_priority: dict[str, int],
                     values: list[str]) -> Metric:
        fam = GaugeMetricFamily(name, doc, labels=self.scheduler_labels)
        fam.add_metric(values, float(total))
        if self.priority_scheduling:
            self._known_priorities.update(by_priority)
            for priority in sorted(self._known_priorities):
                fam.add_metric([*values[:-1], priority], float(by_priority.get(priority, 0)))
        return fam
