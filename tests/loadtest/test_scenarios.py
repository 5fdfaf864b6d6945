"""Tiny scenario runs end to end: processes started and stopped, report and plots written."""

from __future__ import annotations

from pathlib import Path

import psutil

from loadtest import bench, report
from loadtest.scenarios import sweep, trace


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_quick_sweep_and_trace_make_a_report(tmp_path: Path) -> None:
    before = _children()
    s = sweep.SweepSettings(profiles=["seed-coding"], levels=[1, 2],
                            configs=["eagle", "baseline"], time_scale=0.05, rounds=1,
                            min_requests=2, input_tokens=100, output_tokens=16,
                            progress=False, out_dir=str(tmp_path))
    swept = sweep.run_sweep(s, log=lambda _: None)
    levels = swept["profiles"]["seed-coding"]["eagle"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    assert all(lv["completed"] == 2 and lv["output_tokens"] == 32 for lv in levels)
    assert (tmp_path / "sweep-seed-coding-baseline.csv").read_text().count("\n") == 1 + 2 + 2

    t = trace.TraceSettings(trace="accept-shift", configs=["eagle"], time_scale=0.05,
                            length_factor=0.05, input_tokens=100, output_tokens=16,
                            bin_s=1.0, progress=False, out_dir=str(tmp_path))
    traced = trace.run_trace(t, log=lambda _: None)
    eagle = traced["configs"]["eagle"]
    assert "error" not in eagle, eagle.get("error")
    assert set(eagle["phases"]) == {"accept-3.0", "accept-1.6", "accept-3.0-again"}
    assert eagle["summary"]["completed"] > 0 and eagle["timeline"]

    results = {"sweep": swept, "trace:accept-shift": traced}
    images = bench.make_plots(results, tmp_path / "img", tmp_path)
    text = report.render(results, images, ["pytest"], "test run", "now", 1.0)
    assert "| 1 | " in text and "| 2 | " in text
    assert "## Trace `accept-shift`" in text and "Machine:" in text and "Commit:" in text
    for image in images.values():
        assert (tmp_path / image).stat().st_size > 1000
    assert _children() <= before  # every process the scenarios started is gone
