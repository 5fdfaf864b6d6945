"""Telemetry parsers on payloads shaped exactly as SGLang builds them."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from specrouter.observe.telemetry import (
    TelemetryParseError,
    parse_get_load,
    parse_metrics,
    parse_server_info_accept,
    parse_source,
    parse_v1_loads,
)


def v1_loads_rank(rank: int, running: int, waiting: int, accept: float | None) -> dict[str, object]:
    # sglang/srt/entrypoints/v1_loads.py: asdict(GetLoadsReqOutput) minus None and timestamp,
    # plus num_total_reqs.
    d: dict[str, object] = {
        "dp_rank": rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_used_tokens": 4096, "max_total_num_tokens": 500000, "token_usage": 0.01,
        "gen_throughput": 812.5, "cache_hit_rate": 0.4, "utilization": 0.2,
        "max_running_requests": 48, "num_total_reqs": running + waiting,
    }
    if accept is not None:
        d["speculative"] = {"accept_length": accept, "accept_rate": 0.61}
    return d


def test_v1_loads_sums_ranks_and_reads_accept_length() -> None:
    payload = {
        "timestamp": "2026-12-02T13:00:00.000000+00:00", "version": "0.5.10",
        "dp_rank_count": 2,
        "loads": [v1_loads_rank(0, 5, 2, 3.2), v1_loads_rank(1, 3, 0, 2.8)],
        "aggregate": {"total_running_reqs": 8, "total_waiting_reqs": 2, "total_reqs": 10,
                      "avg_token_usage": 0.01, "avg_throughput": 812.5, "avg_utilization": 0.2},
    }
    s = parse_v1_loads(payload, received_at=7.0)
    assert (s.running, s.waiting, s.total, s.source) == (8, 2, 10, "v1_loads")
    assert s.accept_length == pytest.approx(3.0) and s.max_running == 96
    assert s.received_at == 7.0 and s.engine_timestamp == payload["timestamp"]
    # The snapshot's identity: what SGLang freezes between refreshes, over every rank.
    assert s.snapshot == (5.0, 4096.0, 812.5, 3.2, 3.0, 4096.0, 812.5, 2.8)


def test_v1_loads_without_spec_section_and_0_5_23_shape() -> None:
    payload = {"timestamp": "x", "version": "0.5.23", "dp_rank_count": 1,
               "loads": [v1_loads_rank(0, 1, 0, None)]}  # no aggregate in 0.5.23
    s = parse_v1_loads(payload, 0.0)
    assert (s.running, s.waiting, s.accept_length) == (1, 0, None)
    assert s.snapshot is None  # nothing to tell an accept-length reading by


def test_get_load_num_reqs_includes_waiting() -> None:
    # scheduler.get_load: num_reqs = len(running_batch.reqs) + num_waiting_reqs
    payload = [{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 3, "num_tokens": 9000},
               {"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 100}]
    s = parse_get_load(payload, 1.0)
    assert (s.running, s.waiting, s.accept_length, s.source) == (6, 3, None, "get_load")


def sglang_metrics_text(
    running: list[int], queued: list[int], accept: float | None, rank: str = "tp_rank"
) -> str:
    """Exposition produced by prometheus_client with SGLang's metric names and labels."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", rank, "pp_rank"]
    g_run = Gauge("sglang:num_running_reqs", "The number of running requests.", labels,
                  registry=reg)
    g_q = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                labels, registry=reg)
    g_acc = Gauge("sglang:spec_accept_length", "The average acceptance length.", labels,
                  registry=reg)
    c = Counter("sglang:num_requests", "Number of requests.", labels, registry=reg)
    for tp, (r, q) in enumerate(zip(running, queued, strict=True)):
        lv = ("llama", "unified", str(tp), "0")
        g_run.labels(*lv).set(r)
        g_q.labels(*lv).set(q)
        c.labels(*lv).inc(10)
        if accept is not None:
            g_acc.labels(*lv).set(accept)
    return generate_latest(reg).decode()


def test_metrics_text() -> None:
    # Two TP ranks of one batch report the same counts: counted once.
    s = parse_metrics(sglang_metrics_text([4, 4], [1, 1], 2.7), 3.0)
    assert (s.running, s.waiting, s.source) == (4, 1, "metrics")
    assert s.accept_length == pytest.approx(2.7)
    # Two DP ranks are two batches: summed.
    s = parse_metrics(sglang_metrics_text([4, 2], [1, 0], 2.7, rank="dp_rank"), 3.0)
    assert (s.running, s.waiting) == (6, 1)
    assert s.accept_length == pytest.approx(2.7)
    s = parse_metrics(sglang_metrics_text([3], [0], None), 3.0)
    assert (s.running, s.waiting, s.accept_length) == (3, 0, None)


def test_server_info_accept_length() -> None:
    info = {"model_path": "m", "version": "0.5.10",
            "internal_states": [{"last_gen_throughput": 300.0, "avg_spec_accept_length": 3.4}]}
    assert parse_server_info_accept(info) == pytest.approx(3.4)
    assert parse_server_info_accept({"internal_states": [{"last_gen_throughput": 1.0}]}) is None


@pytest.mark.parametrize("source,body,match", [
    ("v1_loads", json.dumps({"loads": [{"num_running_reqs": 1}]}), "num_waiting_reqs"),
    ("v1_loads", json.dumps([1, 2]), "'loads' list"),
    ("get_load", json.dumps({"num_reqs": 1}), "list"),
    ("get_load", "<html>", "not JSON"),
    ("metrics", "# HELP x\nfoo 1\n", "num_running_reqs"),
])
def test_bad_payloads_are_clear_errors(source: str, body: str, match: str) -> None:
    with pytest.raises(TelemetryParseError, match=match):
        parse_source(source, body, 0.0)
