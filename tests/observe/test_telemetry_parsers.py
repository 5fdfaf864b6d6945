"""Telemetry parsers on payloads shaped exactly as SGLang builds them."""

from __future__ import annotations

import datetime
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


def test_v1_loads_sums_ranks_and_keeps_the_lifetime_accept_apart() -> None:
    payload = {
        "timestamp": "2026-12-02T13:00:00.000000+00:00", "version": "0.5.10",
        "dp_rank_count": 2,
        "loads": [v1_loads_rank(0, 5, 2, 3.2), v1_loads_rank(1, 3, 0, 2.8)],
        "aggregate": {"total_running_reqs": 8, "total_waiting_reqs": 2, "total_reqs": 10,
                      "avg_token_usage": 0.01, "avg_throughput": 812.5, "avg_utilization": 0.2},
    }
    s = parse_v1_loads(payload, received_at=7.0)
    assert (s.running, s.waiting, s.total, s.source) == (8, 2, 10, "v1_loads")
    assert s.max_running == 96
    assert s.received_at == 7.0 and s.engine_timestamp == payload["timestamp"]
    # SGLang's speculative.accept_length is the mean since start: never a drift reading.
    assert s.accept_length is None and s.accept_window is None
    assert s.accept_lifetime == pytest.approx(3.0)
    assert s.snapshot_age is None  # 0.5.10 answers live and carries no rank timestamp
    assert s.gen_throughput == pytest.approx(2 * 812.5)  # DP ranks decode apart: summed
    assert (s.kv_tokens, s.kv_used) == (1_000_000, 8192)  # each rank has its own KV pool


def v1_loads_0_5_23(answered: str, taken: list[float]) -> dict[str, object]:
    """0.5.23's shape (entrypoints/v1_loads.py, load_snapshot.py LoadSnapshot.to_dict):
    no dp_rank_count nor aggregate; every rank with the float `timestamp` of its snapshot."""
    loads = []
    for rank, at in enumerate(taken):
        entry = v1_loads_rank(rank, 2, 1, 1.9)
        entry.update({"timestamp": at, "num_waiting_uncached_tokens": 0,
                      "num_active_tokens": 300})
        loads.append(entry)
    return {"timestamp": answered, "version": "0.5.23", "accelerator": "NVIDIA H200",
            "num_accelerators": 1, "loads": loads}


def test_v1_loads_0_5_23_snapshot_age_on_the_servers_own_clock() -> None:
    # The server's wall clock is far from the router's monotonic one: only its own
    # timestamps are compared (answer built at ...:00.750, oldest rank snapshot at .250).
    answered = "2026-12-02T13:00:00.750000+00:00"
    built = datetime.datetime.fromisoformat(answered).timestamp()
    s = parse_v1_loads(v1_loads_0_5_23(answered, [built - 0.2, built - 0.5]), received_at=3.0)
    assert (s.running, s.waiting) == (4, 2)
    assert s.snapshot_age == pytest.approx(0.5)
    assert s.taken_at == pytest.approx(2.5)
    # A rank without its timestamp, or an answer without one: the age is unknown.
    payload = v1_loads_0_5_23(answered, [built])
    del payload["timestamp"]
    assert parse_v1_loads(payload, 3.0).snapshot_age is None


def test_v1_loads_without_spec_section() -> None:
    payload = {"timestamp": "x", "version": "0.5.23", "loads": [v1_loads_rank(0, 1, 0, None)]}
    s = parse_v1_loads(payload, 0.0)
    assert (s.running, s.waiting, s.accept_length, s.accept_lifetime) == (1, 0, None, None)
    assert s.snapshot_age is None


def test_an_empty_loads_list_is_no_data_not_a_zero_load() -> None:
    # 0.5.23 answers "loads": [] when its snapshot reader is not attached.
    payload = {"timestamp": "2026-12-02T13:00:00+00:00", "version": "0.5.23",
               "accelerator": "NVIDIA H200", "num_accelerators": 1, "loads": []}
    with pytest.raises(TelemetryParseError, match="no data"):
        parse_v1_loads(payload, 0.0)


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
    assert s.accept_length == pytest.approx(2.7) and s.accept_window == (2.7,)
    # Two DP ranks are two batches: summed.
    s = parse_metrics(sglang_metrics_text([4, 2], [1, 0], 2.7, rank="dp_rank"), 3.0)
    assert (s.running, s.waiting) == (6, 1)
    assert s.accept_length == pytest.approx(2.7) and s.accept_window == (2.7, 2.7)
    s = parse_metrics(sglang_metrics_text([3], [0], None), 3.0)
    assert (s.running, s.waiting, s.accept_length, s.accept_window) == (3, 0, None, None)
    assert s.gen_throughput is None  # no gauge: not a zero throughput


def test_metrics_gen_throughput_per_batch_summed_over_dp_ranks() -> None:
    reg = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "dp_rank"]
    run = Gauge("sglang:num_running_reqs", "The number of running requests.", labels,
                registry=reg)
    rate = Gauge("sglang:gen_throughput", "The generation throughput (token/s).", labels,
                 registry=reg)
    for tp, dp, r, tok_s in (("0", "0", 4, 300.0), ("1", "0", 4, 300.0), ("0", "1", 2, 120.0)):
        run.labels("llama", "unified", tp, dp).set(r)
        rate.labels("llama", "unified", tp, dp).set(tok_s)
    s = parse_metrics(generate_latest(reg).decode(), 1.0)
    assert s.running == 6 and s.gen_throughput == pytest.approx(420.0)


SCHEDULER_LABELS = 'model_name="llama",engine_type="unified"'


def exposition(lines: list[str]) -> str:
    """Prometheus text as SGLang's scheduler collector writes it (metrics_collector.py)."""
    return "\n".join([
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        *[ln for ln in lines if ln.startswith("sglang:num_running_reqs")],
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
        "# TYPE sglang:num_queue_reqs gauge",
        *[ln for ln in lines if ln.startswith("sglang:num_queue_reqs")],
        "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
        "# TYPE sglang:spec_accept_length gauge",
        *[ln for ln in lines if ln.startswith("sglang:spec_accept_length")],
    ]) + "\n"


def test_metrics_priority_breakdown_is_not_counted_twice() -> None:
    # With priority scheduling SGLang writes the total under priority="" and each
    # priority's share beside it (_log_gauge_queue_count).
    ranks = f'{SCHEDULER_LABELS},tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    text = exposition([
        f'sglang:num_running_reqs{{{ranks},priority=""}} 7.0',
        f'sglang:num_running_reqs{{{ranks},priority="0"}} 5.0',
        f'sglang:num_running_reqs{{{ranks},priority="10"}} 2.0',
        f'sglang:num_queue_reqs{{{ranks},priority=""}} 3.0',
        f'sglang:num_queue_reqs{{{ranks},priority="10"}} 3.0',
        f'sglang:spec_accept_length{{{ranks},priority=""}} 2.4',
    ])
    s = parse_metrics(text, 1.0)
    assert (s.running, s.waiting) == (7, 3)
    assert s.accept_length == pytest.approx(2.4)


def test_metrics_moe_ep_copies_once_dp_ranks_summed() -> None:
    # Expert-parallel ranks run one batch (moe_ep_rank copies, like tp/pp); DP ranks
    # are separate batches.
    lines = []
    for dp, (running, accept) in enumerate(((6, 2.0), (4, 3.0))):
        for ep in range(4):
            labels = (f'{SCHEDULER_LABELS},tp_rank="{ep}",pp_rank="0",'
                      f'moe_ep_rank="{ep}",dp_rank="{dp}"')
            lines += [f"sglang:num_running_reqs{{{labels}}} {running}.0",
                      f"sglang:num_queue_reqs{{{labels}}} 1.0",
                      f"sglang:spec_accept_length{{{labels}}} {accept}"]
    s = parse_metrics(exposition(lines), 1.0)
    assert (s.running, s.waiting) == (10, 2)
    assert s.accept_length == pytest.approx(2.5) and s.accept_window == (2.0, 3.0)


def test_metrics_accept_before_the_first_fold_is_no_reading() -> None:
    # SGLang's gauge reads 0 until 40 decode batches were folded in.
    labels = f'{SCHEDULER_LABELS},tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    s = parse_metrics(exposition([f"sglang:num_running_reqs{{{labels}}} 1.0",
                                  f"sglang:spec_accept_length{{{labels}}} 0.0"]), 1.0)
    assert s.accept_length is None and s.accept_window == (0.0,)


def test_server_info_accept_length() -> None:
    info = {"model_path": "m", "version": "0.5.10",
            "internal_states": [{"last_gen_throughput": 300.0, "avg_spec_accept_length": 3.4}]}
    assert parse_server_info_accept(info) == pytest.approx(3.4)
    assert parse_server_info_accept({"internal_states": [{"last_gen_throughput": 1.0}]}) is None


@pytest.mark.parametrize("source,body,match", [
    ("v1_loads", json.dumps({"loads": [{"num_running_reqs": 1}]}), "num_waiting_reqs"),
    ("v1_loads", json.dumps([1, 2]), "'loads' list"),
    ("v1_loads", json.dumps({"timestamp": "t", "loads": []}), "no data"),
    ("get_load", json.dumps({"num_reqs": 1}), "list"),
    ("get_load", "<html>", "not JSON"),
    ("metrics", "# HELP x\nfoo 1\n", "num_running_reqs"),
])
def test_bad_payloads_are_clear_errors(source: str, body: str, match: str) -> None:
    with pytest.raises(TelemetryParseError, match=match):
        parse_source(source, body, 0.0)


def test_metrics_reads_only_the_gauges_it_uses() -> None:
    # SGLang's /metrics carries many other families (histograms, counters, gauges whose
    # names start like the ones read); only the read gauges are parsed, so a family the
    # router never reads, even one it could not parse, does not cost a reading.
    registry = CollectorRegistry()
    labels = ["model_name", "tp_rank", "pp_rank", "moe_ep_rank"]
    values = ["llama", "0", "0", "0"]
    for name, value in (("sglang:num_running_reqs", 6.0), ("sglang:num_queue_reqs", 2.0),
                        ("sglang:spec_accept_length", 2.75),
                        ("sglang:num_running_reqs_offline_batch", 40.0)):
        Gauge(name, "g", labels, registry=registry).labels(*values).set(value)
    hist = Histogram(
        "sglang:time_to_first_token_seconds", "h", labels, registry=registry)
    hist.labels(*values).observe(0.3)
    Counter("sglang:prompt_tokens", "c", labels, registry=registry).labels(*values).inc(9)
    text = generate_latest(registry).decode() + 'sglang:broken_family{a="1" 2.0\n'
    s = parse_metrics(text, 1.0)
    assert (s.running, s.waiting) == (6, 2)
    assert s.accept_length == pytest.approx(2.75) and s.accept_window == (2.75,)
