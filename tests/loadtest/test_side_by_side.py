"""The report of a side-by-side overhead run: one row per level and path, and the CPU
comparison with the peer router judged per level."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.metrics import RequestResult
from loadtest.scenarios.overhead import (
    OverheadSettings,
    _path_figures,
    chunk_split,
    side_by_side_lines,
)


def _path(cpu: float, req_s: float, added: float | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"requests": 10, "errors": 0, "req_s": req_s,
                               "cpu_ms_per_request": cpu, "ttft_p50_ms": 5.0,
                               "ttft_p99_ms": 9.0}
    if added is not None:
        figures["added_p50_ms"], figures["added_p99_ms"] = added, added * 2
    return figures


def _level(c: int, ours: float, theirs: float, scaling: float = 1.0) -> dict[str, Any]:
    rate = {name: {**_path(0.5, 100.0), "vs_lowest_level": 1.0, "vs_direct": 1.0}
            for name in ("direct", "specrouter", "peer")}
    rate["specrouter"]["vs_lowest_level"] = scaling
    return {"concurrency": c, "rate": rate,
            "streams": {"direct": _path(1.0, 50.0), "specrouter": _path(ours, 50.0, 0.5),
                        "peer": _path(theirs, 50.0, 0.7)}}


def test_each_level_is_judged_on_cpu_against_the_peer() -> None:
    result = {"paths": ["direct", "specrouter", "peer"],
              "levels": [_level(16, 0.4, 0.5), _level(100, 0.6, 0.5)]}
    lines = side_by_side_lines(result)
    rows = [line for line in lines if line.startswith("| 16 ") or line.startswith("| 100 ")]
    assert len(rows) == 6
    verdicts = [line for line in lines if line.startswith("- ")]
    assert "0.80x): met" in verdicts[0]
    assert "1.20x): **missed**" in verdicts[1]


def test_throughput_past_the_lowest_level_is_judged_against_0_9x() -> None:
    result = {"paths": ["direct", "specrouter", "peer"],
              "levels": [_level(16, 0.4, 0.5), _level(100, 0.4, 0.5, scaling=0.95),
                         _level(400, 0.4, 0.5, scaling=0.85)]}
    verdicts = [line for line in side_by_side_lines(result) if line.startswith("- ")]
    assert "target" not in verdicts[0]  # the lowest level is the reference
    assert verdicts[1].endswith("0.95x the lowest level's (target >= 0.9x): met")
    assert verdicts[2].endswith("0.85x the lowest level's (target >= 0.9x): **missed**")


def test_the_latency_of_a_phase_s_starting_burst_is_left_out_but_its_cpu_counted() -> None:
    # A phase starts all its users at once; the requests of its first settle_s queue
    # behind each other and would set the p99. They still ran, so CPU and rate count them.
    s = OverheadSettings(settle_s=0.5)
    burst = [RequestResult(start=0.01 * i, ok=True, ttft=0.030) for i in range(10)]
    steady = [RequestResult(start=0.5 + 0.1 * i, ok=True, ttft=0.002) for i in range(90)]
    figures = _path_figures(burst + steady, cpu=(0.06, 0.04), seconds=10.0, s=s)
    assert figures["ttft_p99_ms"] == pytest.approx(2.0)
    assert figures["requests"] == 100 and figures["req_s"] == pytest.approx(10.0)
    assert figures["cpu_ms_per_request"] == pytest.approx(1.0)
    assert figures["user_ms_per_request"] == pytest.approx(0.6)
    assert figures["sys_ms_per_request"] == pytest.approx(0.4)


def _cpu(user_ms: float, sys_ms: float) -> dict[str, float]:
    return {"user_ms_per_request": user_ms, "sys_ms_per_request": sys_ms}


def test_a_streamed_request_s_cpu_splits_into_its_chunks_and_the_rest() -> None:
    # 20 us of user and 10 of system time per chunk, 300 and 50 per request: 16 chunks
    # cost 0.620 / 0.210 ms, 2 chunks over the same time 0.340 / 0.070 ms.
    split = chunk_split(_cpu(0.620, 0.210), _cpu(0.340, 0.070), (16, 2))
    assert split["per_chunk_user_us"] == pytest.approx(20.0)
    assert split["per_chunk_sys_us"] == pytest.approx(10.0)
    assert split["per_request_user_us"] == pytest.approx(300.0)
    assert split["per_request_sys_us"] == pytest.approx(50.0)


def test_the_report_shows_each_router_s_split() -> None:
    result = {"paths": ["direct", "specrouter", "peer"], "levels": [_level(100, 0.4, 0.5)],
              "chunk_split": {"concurrency": 100, "chunks": [16, 2], "paths": {
                  name: chunk_split(_cpu(0.620, 0.210), _cpu(0.340, 0.070), (16, 2))
                  for name in ("direct", "specrouter", "peer")}}}
    lines = side_by_side_lines(result)
    rows = [line for line in lines if line.startswith("| specrouter |")
            or line.startswith("| peer |")]
    assert rows == ["| specrouter | 20.0 | 10.0 | 300.0 | 50.0 |",
                    "| peer | 20.0 | 10.0 | 300.0 | 50.0 |"]


def test_specrouter_is_judged_against_the_named_peer_not_a_reference_path() -> None:
    streams = {"direct": _path(1.0, 50.0), "specrouter": _path(0.6, 50.0, 0.5),
               "floor": _path(0.3, 50.0, 0.1), "peer": _path(0.5, 50.0, 0.7)}
    rate = {name: {**_path(0.5, 100.0), "vs_lowest_level": 1.0, "vs_direct": 1.0}
            for name in streams}
    result = {"paths": list(streams), "judged_against": "peer",
              "path_notes": {"floor": "a relay that does nothing else"},
              "levels": [{"concurrency": 16, "streams": streams, "rate": rate}]}
    lines = side_by_side_lines(result)
    verdicts = [line for line in lines if line.startswith("- ")]
    assert len(verdicts) == 1 and "peer 0.500 ms (1.20x): **missed**" in verdicts[0]
    assert "`floor`: a relay that does nothing else." in lines
