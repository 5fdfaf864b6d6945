"""/metrics in SGLang's Prometheus names and labels, for one simulated engine.

Gauges come from the engine's periodic snapshot (SGLang refreshes them every
--decode-log-interval decode steps, not live); counters are live. Latencies are simulated
seconds, so a run at --time-scale 0.1 reports what the same run at full scale would.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specrouter.sim.engine import Engine

LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")
TTFT_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)


class EngineMetrics(Collector):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.label_values = [model_name, "unified", "0", "0"]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", LABELS,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(
                                  *self.label_values)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", LABELS,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(
                                 *self.label_values)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", LABELS,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(
                                 *self.label_values)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        e, g, c = self.engine, self.engine.gauges, self.engine.counters
        cap = e.limits.kv_capacity_tokens
        gauges = [
            ("sglang:num_running_reqs", "The number of running requests.", g.num_running_reqs),
            ("sglang:num_used_tokens", "The number of used tokens.", g.num_used_tokens),
            ("sglang:token_usage", "The token usage.", g.num_used_tokens / cap),
            ("sglang:gen_throughput", "The generation throughput (token/s).", g.gen_throughput),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
             g.num_waiting_reqs),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", 0.0),
            ("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
             g.accept_length if e.is_eagle else 0.0),
            ("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.",
             _accept_rate(e) if e.is_eagle else 0.0),
            ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
             cap),
        ]
        for name, doc, value in gauges:
            fam = GaugeMetricFamily(name, doc, labels=LABELS)
            fam.add_metric(self.label_values, float(value))
            yield fam
        counters = [
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
            ("sglang:generation_tokens", "Number of generation tokens processed.",
             c.generated_tokens),
            ("sglang:num_requests", "Number of requests processed.", c.requests),
            ("sglang:num_aborted_requests", "Number of requests aborted.", c.aborted),
        ]
        for name, doc, value in counters:
            cfam = CounterMetricFamily(name, doc, labels=LABELS)
            cfam.add_metric(self.label_values, float(value))
            yield cfam


def _accept_rate(engine: Engine) -> float:
    """Accepted draft tokens over proposed draft tokens (the bonus token is not a draft)."""
    length = engine.gauges.accept_length
    drafts = engine.profile.draft.num_draft_tokens - 1
    return max(0.0, (length - 1.0) / drafts) if length > 0 and drafts > 0 else 0.0
