"""The agentic section of the report: a recorded result renders its table and its plot."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import bench, report

# `python -m loadtest.bench --quick`'s agentic result (h200-llama3-8b, 1.5 sessions/s)
RECORDED = Path(__file__).parent / "data" / "agentic-quick.json"


def test_report_plots_each_profile_and_shows_the_plot(tmp_path: Path) -> None:
    results = {"agentic": json.loads(RECORDED.read_text(encoding="utf-8"))}
    images = bench.make_plots(results, tmp_path / "img", tmp_path)
    assert set(images) == {"agentic:h200-llama3-8b"}
    assert (tmp_path / images["agentic:h200-llama3-8b"]).stat().st_size > 1000
    text = report.render(results, images, ["pytest"], "test run", "now", 1.0)
    assert "![agentic h200-llama3-8b](img/agentic-h200-llama3-8b.png)" in text
    assert "| router | 347.0 |" in text


def test_a_best_static_pool_that_met_the_slo_on_every_turn_is_called_out_of_reach() -> None:
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    level = recorded["profiles"]["h200-llama3-8b"][0]
    best = level["configs"][level["verdict"]["best_static"]]
    assert best["slo_met"] == best["requests"] and not best.get("unsent_turns")
    lines, misses = report.agentic_section(recorded, {})
    assert any("vs best static pool" in line and "out of reach" in line for line in lines)
    # a best pool that missed the SLO on one turn leaves the ratio to speak for itself
    best["slo_met"] -= 1
    lines, misses = report.agentic_section(recorded, {})
    assert not any("out of reach" in line for line in [*lines, *misses])


def test_a_router_behind_the_adaptive_engine_is_shown_what_differs() -> None:
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    level = recorded["profiles"]["h200-llama3-8b"][0]
    assert level["verdict"]["vs_adaptive"]["met"] is False
    lines, misses = report.agentic_section(recorded, {})
    (line,) = [x for x in lines if "router vs adaptive" in x]
    # the recorded quick run: the same cache, the router's TPOT p90 1 ms lower
    assert ("cached share 84.1% against 84.1%, prefill 0.24 against 0.24 Mtok, "
            "TPOT p90 5.0 against 6.0 ms" in line), line
    assert any("the adaptive engine" in m and "why: see below" in m for m in misses)
    level["verdict"]["vs_adaptive"]["met"] = True
    lines, _ = report.agentic_section(recorded, {})
    assert not any("measured beside it" in x for x in lines)


def test_a_repeated_cell_shows_every_runs_goodput() -> None:
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    router = recorded["profiles"]["h200-llama3-8b"][0]["configs"]["router"]
    router["goodput_runs"] = [320.5, 347.0, 361.25]
    lines, _ = report.agentic_section(recorded, {})
    assert any(x.startswith("| router | 347.0 (runs 320.5 / 347.0 / 361.2) |") for x in lines)


def test_the_slo_router_gets_a_line_of_its_own_and_no_miss() -> None:
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    level = recorded["profiles"]["h200-llama3-8b"][0]
    _, misses = report.agentic_section(recorded, {})
    level["verdict_slo"] = {**level["verdict"],
                            "vs_best_static": {"ratio": 1.31, "target": 1.2, "met": True}}
    lines, with_slo = report.agentic_section(recorded, {})
    (line,) = [x for x in lines if x.startswith("- router-slo")]
    assert "1.31x the best static pool" in line and "cached share gap" in line
    assert with_slo == misses  # the targets judge `router` alone


def test_the_stream_renders_as_its_own_section_with_its_own_plot(tmp_path: Path) -> None:
    burst = json.loads(RECORDED.read_text(encoding="utf-8"))
    stream = json.loads(RECORDED.read_text(encoding="utf-8"))
    stream["settings"]["profile_window_s"] = {"h200-llama3-8b": 120.0}
    results = {"agentic": burst, "agentic-stream": stream}
    images = bench.make_plots(results, tmp_path / "img", tmp_path)
    assert set(images) == {"agentic:h200-llama3-8b", "agentic-stream:h200-llama3-8b"}
    text = report.render(results, images, ["pytest"], "test run", "now", 1.0)
    burst_part, stream_part = text.split("## Agentic sessions as a stream")
    assert "## Agentic multi-turn sessions" in burst_part
    assert "over 8 simulated s (open loop)" in burst_part  # the recorded quick run's window
    assert "over 120 simulated s (open loop)" in stream_part
    assert "![agentic-stream h200-llama3-8b](img/agentic-stream-h200-llama3-8b.png)" in text
    # each miss names the section it comes from
    _, burst_misses = report.agentic_section(burst, {})
    _, stream_misses = report.agentic_section(stream, {}, "agentic-stream")
    assert burst_misses and all(m.startswith("agentic h200") for m in burst_misses)
    assert [m.replace("agentic-stream ", "agentic ", 1) for m in stream_misses] == burst_misses
