"""The open-loop scenario: its workload generators' statistics, the rates it derives, the
verdict arithmetic, and one tiny run end to end (simulator, router, report, plot)."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import psutil
import pytest

from loadtest import bench, report
from loadtest.scenarios import openloop
from loadtest.workload import (
    LengthDist,
    OnOff,
    onoff_workload,
    poisson_times,
    poisson_workload,
)


def test_lengths_are_lognormal_clipped_and_their_mean_is_exact() -> None:
    dist = LengthDist(median=200, sigma=0.8, low=16, high=1024)
    rng = random.Random(1)
    draws = [dist.draw(rng) for _ in range(40_000)]
    assert min(draws) >= 16 and max(draws) <= 1024
    assert draws.count(1024) > 0  # the tail reaches the cap
    assert statistics.median(draws) == pytest.approx(200, rel=0.03)
    assert statistics.fmean(draws) == pytest.approx(dist.mean(), rel=0.01)
    # unclipped, the mean is exp(mu + sigma^2 / 2)
    wide = LengthDist(median=200, sigma=0.8, low=1, high=10**9)
    assert wide.mean() == pytest.approx(200 * math.exp(0.32), rel=1e-6)
    assert LengthDist(100, 0.0, 1, 50).mean() == 50.0
    with pytest.raises(ValueError):
        LengthDist(100, 0.5, 10, 5)


def test_poisson_gaps_are_exponential_at_the_rate() -> None:
    times = poisson_times(4.0, 20_000, random.Random(2))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)
    assert times == sorted(times)
    with pytest.raises(ValueError):
        poisson_times(0.0, 3, random.Random(0))


def test_on_off_arrivals_follow_the_square_wave() -> None:
    pattern = OnOff(on_rate=20.0, off_rate=1.0, on_s=5.0, off_s=10.0, cycles=200)
    times = pattern.times(random.Random(3))
    assert all(0 <= t < pattern.duration_s for t in times)
    on = sum(1 for t in times if pattern.rate_at(t) == 20.0)
    off = len(times) - on
    assert on == pytest.approx(200 * 20 * 5, rel=0.03)
    assert off == pytest.approx(200 * 1 * 10, rel=0.07)
    assert len(times) == pytest.approx(pattern.expected_count(), rel=0.03)
    silent = OnOff(on_rate=5.0, off_rate=0.0, on_s=1.0, off_s=3.0, cycles=3)
    assert all(silent.rate_at(t) == 5.0 for t in silent.times(random.Random(4)))


def test_workloads_repeat_exactly_from_their_seed() -> None:
    lengths = LengthDist(300, 0.8, 16, 4000), LengthDist(200, 0.8, 16, 1024)
    a = poisson_workload(2.0, 50, *lengths, seed=9)
    assert a == poisson_workload(2.0, 50, *lengths, seed=9)
    assert a != poisson_workload(2.0, 50, *lengths, seed=10)
    assert len({x.output_tokens for x in a}) > 10  # mixed lengths, not one shape
    pattern = OnOff(on_rate=10.0, off_rate=0.5, on_s=2.0, off_s=8.0, cycles=2)
    assert onoff_workload(pattern, *lengths, seed=1) == onoff_workload(pattern, *lengths, seed=1)


def test_rates_come_from_the_better_pool_at_the_saturation_batch() -> None:
    # 1000 tok/s of decode, 250 tokens a request: 4 req/s of decode; 50 ms of prefill
    # each: 1 / (0.25 + 0.05) req/s
    assert openloop.capacity_req_s(1000.0, 250.0, 50.0) == pytest.approx(1 / 0.3)
    s = openloop.OpenLoopSettings()
    for profile in ("seed-coding", "h200-llama3-8b"):
        cap = openloop.capacity(profile, s.inputs, s.outputs)
        pools = cap["pools"]
        # both profiles' baselines serve more at 64 requests (EAGLE is capped at 48)
        assert cap["better"] == "baseline" and pools["eagle"]["batch"] == 48
        assert cap["saturation_req_s"] == pools["baseline"]["req_s"] > pools["eagle"]["req_s"]
        rates = openloop.rates_for(cap["saturation_req_s"], s.fractions)
        assert len(rates) >= 5 and rates == sorted(rates)
        assert rates[-1] == pytest.approx(1.1 * cap["saturation_req_s"], rel=1e-2)
        top = max(s.fractions_of(profile))
        # the top rate is beyond EAGLE-3's capacity: a router must move to the baseline
        assert rates[-1] > pools["eagle"]["req_s"]
    assert top == 1.4  # h200's EAGLE-3 is ahead of the estimate (PROFILE_FRACTIONS)
    cap, loads = openloop.loads_of("seed-coding", s)
    assert [ld.name for ld in loads][-1] == "burst"
    counts = [len(ld.arrivals) for ld in loads if ld.rate is not None]
    assert counts[0] == s.min_requests and counts == sorted(counts)
    # the top rate (1.1 x saturation) arrives over the time 192 requests take at saturation
    assert 209 <= counts[-1] <= 214
    assert openloop.requests_at(1.0, 2.0, 32, 192) == 96
    assert openloop.requests_at(0.1, 2.0, 32, 192) == 32


def _row(load: str, tput: float, p50: float, ttft99: float, errors: int = 0
         ) -> dict[str, Any]:
    return {"load": load, "output_tok_s": tput, "e2e": {"p50": p50},
            "ttft": {"p99": ttft99}, "errors": errors}


def test_verdict_compares_with_the_pool_of_lower_median_and_checks_every_rate() -> None:
    data = {
        "loads": [{"name": "rate 1", "rate": 1.0}, {"name": "rate 2", "rate": 2.0},
                  {"name": "burst", "rate": None}],
        "configs": {
            "eagle": {"loads": [_row("rate 1", 100, 1.0, 0.10), _row("rate 2", 150, 2.0, 0.2),
                                _row("burst", 150, 2.0, 0.2)]},
            "baseline": {"loads": [_row("rate 1", 90, 1.2, 0.05), _row("rate 2", 200, 1.5, 0.3),
                                   _row("burst", 200, 1.5, 0.3)]},
            # at the edge of every target at rate 1; misses latency at rate 2
            "router": {"loads": [_row("rate 1", 97, 1.05, 0.11), _row("rate 2", 200, 1.6, 0.2),
                                 _row("burst", 10, 9.0, 9.0)]},
            "router-calibrated": {"loads": [_row("rate 1", 100, 1.0, 0.05),
                                            _row("rate 2", 200, 1.5, 0.2, errors=1),
                                            _row("burst", 200, 1.5, 0.2)]},
        },
    }
    cmp = openloop.compare_profile(data)
    first = cmp["rows"][0]
    # EAGLE-3 has the lower median: its TTFT p99 is the reference, though the
    # baseline's is lower; throughput is against the higher of the two
    assert first["best"] == {"pool": "eagle", "output_tok_s": 100, "e2e_p50": 1.0,
                             "ttft_p99": 0.10, "ttft_p99_lowest": 0.05}
    edge = first["routers"]["router"]
    assert edge["throughput_ratio"] == pytest.approx(0.97)
    assert edge["latency_ratio"] == pytest.approx(1.05)
    assert edge["ttft_p99_ratio"] == pytest.approx(1.1)
    assert edge["ttft_p99_ratio_lowest"] == pytest.approx(2.2)
    assert edge["meets"]
    # at rate 2 the baseline has the lower median, and its TTFT p99 the reference
    assert cmp["rows"][1]["best"]["pool"] == "baseline"
    assert cmp["rows"][1]["routers"]["router-calibrated"]["ttft_p99_ratio"] == pytest.approx(
        0.2 / 0.3)
    second = cmp["rows"][1]["routers"]
    assert not second["router"]["meets_latency"] and second["router"]["meets_throughput"]
    assert not second["router-calibrated"]["meets"]  # figures fine, but an error
    # the burst is compared but not judged
    assert not cmp["rows"][2]["routers"]["router"]["meets"]
    assert cmp["verdict"]["router"] == {"rates": 2, "met": 1, "meets_all": False}
    assert cmp["verdict"]["router-calibrated"]["met"] == 1


def test_the_ttft_target_judges_the_deployed_ttft_where_every_config_has_it() -> None:
    def deployed(row: dict[str, Any], p99: float) -> dict[str, Any]:
        return {**row, "ttft_deployed": {"p99": p99}}

    data = {
        "loads": [{"name": "rate 1", "rate": 1.0}],
        "configs": {
            "eagle": {"loads": [deployed(_row("rate 1", 100, 1.0, 0.10), 0.090)]},
            "baseline": {"loads": [deployed(_row("rate 1", 90, 1.2, 0.12), 0.110)]},
            # whole conversion 1.3x EAGLE-3's (a proxy's real time 1 / scale times over),
            # deployed 1.05x
            "router": {"loads": [deployed(_row("rate 1", 100, 1.0, 0.13), 0.0945)]},
        },
    }
    row = openloop.compare_profile(data)["rows"][0]
    assert row["best"]["ttft_p99"] == 0.090 and row["best"]["ttft_p99_lowest"] == 0.090
    judged = row["routers"]["router"]
    assert judged["ttft_p99_ratio"] == pytest.approx(1.05) and judged["meets_ttft"]
    assert judged["ttft_deployed"] and judged["ttft_p99_excess_s"] == pytest.approx(0.0045)
    # a config whose engine time was not read is compared on the whole conversion, and so
    # is the pool it is compared with
    data["configs"]["router"] = {"loads": [_row("rate 1", 100, 1.0, 0.13)]}
    whole = openloop.compare_profile(data)["rows"][0]["routers"]["router"]
    assert whole["ttft_p99_ratio"] == pytest.approx(1.3) and not whole["ttft_deployed"]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_tiny_open_loop_run_end_to_end(tmp_path: Path) -> None:
    before = _children()
    s = openloop.OpenLoopSettings(
        profiles=["seed-coding"], configs=["eagle", "router"],
        fractions=[0.2, 0.8], min_requests=4, saturation_requests=4,
        profile_time_scales={"seed-coding": 0.05},
        input_median=100, input_high=400, output_median=12, output_sigma=0.5, output_low=4,
        output_high=24, burst_cycles=1, burst_on_arrivals=3, burst_off_arrivals=1,
        calibrate=False, progress=False, out_dir=str(tmp_path))
    result = openloop.run_openloop(s, log=lambda _: None)
    data = result["profiles"]["seed-coding"]
    _, loads = openloop.loads_of("seed-coding", s)
    for config in ("eagle", "router"):
        rows = data["configs"][config]["loads"]
        assert [r["load"] for r in rows] == [ld.name for ld in loads]
        for row, load in zip(rows, loads, strict=True):
            assert row["errors"] == 0 and row["completed"] == len(load.arrivals)
            # each request generated its own scheduled length (ignore_eos)
            assert row["output_tokens"] == sum(a.output_tokens for a in load.arrivals)
            # every request's stay in the engines was read: the proxies' real time counts
            # once in the deployed TTFT, 1 / time scale times in the whole conversion
            assert 0 < row["ttft_deployed"]["p99"] <= row["ttft"]["p99"]
    assert set(data["configs"]["router"]["loads"][0]["by_pool"]) <= {"eagle", "baseline"}
    assert "SPECROUTER_TELEMETRY__INTERVAL_S" in data["configs"]["router"]["env"]
    verdict = result["comparison"]["seed-coding"]["verdict"]["router"]
    assert verdict["rates"] == 2

    results = {"openloop": result}
    images = bench.make_plots(results, tmp_path / "img", tmp_path)
    assert (tmp_path / images["openloop:seed-coding"]).stat().st_size > 1000
    text = report.render(results, images, ["pytest"], "", "now", 1.0)
    assert "## Open loop" in text and "| rate " in text and "| burst | router |" in text
    assert "router (done-when): met every target at" in text
    assert (tmp_path / "openloop-seed-coding-router.csv").read_text().count("\n") == 1 + sum(
        len(ld.arrivals) for ld in loads)
    assert _children() <= before


def test_configs_differ_only_by_what_a_user_would_set(tmp_path: Path) -> None:
    model = {"format": "specrouter-cost-model", "version": 1, "nominal_accept_length": 2.0,
             "eagle": {"points": [[1.0, 4.0], [8.0, 8.0]]}, "baseline": {"poly": [2.0, 0.1, 0.0]}}
    calibration = {"policy": {"mode": "auto", "strategy": "threshold", "switch_up": 0.7},
                   "cost_model": model, "time_scale": 0.1}
    default = openloop.config_env("router", calibration, 0.1, "seed-coding", tmp_path)
    assert "SPECROUTER_COST_MODEL" not in default
    policy = json.loads(default["SPECROUTER_POLICY"])
    # nothing but the router's time constants, on the simulator's clock
    assert "strategy" not in policy and "switch_up" not in policy
    assert all(key.endswith("_s") for key in policy)
    assert float(default["SPECROUTER_TELEMETRY__INTERVAL_S"]) == pytest.approx(0.01)

    calibrated = openloop.config_env("router-calibrated", calibration, 0.1, "seed-coding",
                                     tmp_path)
    # calibrate's default strategy (online), seeded with the fitted model; no band
    assert {k: v for k, v in json.loads(calibrated["SPECROUTER_POLICY"]).items()
            if not k.endswith("_s")} == {"mode": "auto", "strategy": "online"}
    source = json.loads(calibrated["SPECROUTER_COST_MODEL"])
    # timed on the wall clock at time scale 0.1, served in the simulator's milliseconds
    served = json.loads(Path(source["file"]).read_text())
    assert served["eagle"] == {"points": [[1.0, 40.0], [8.0, 80.0]]}
    assert served["baseline"] == {"poly": [20.0, 1.0, 0.0]}
    no_model = openloop.config_env("router-calibrated", {"policy": {}}, 0.1, "seed-coding",
                                   tmp_path)
    assert "SPECROUTER_COST_MODEL" not in no_model

    goodput = openloop.config_env("router-goodput", calibration, 0.1, "seed-coding", tmp_path)
    assert json.loads(goodput["SPECROUTER_POLICY"])["strategy"] == "goodput"
    assert json.loads(goodput["SPECROUTER_POLICY"])["switch_up"] == 0.7
    assert json.loads(goodput["SPECROUTER_COST_MODEL"])["profile"] == "seed-coding"


def test_router_env_from_the_command_line_reaches_every_router_config() -> None:
    parser = argparse.ArgumentParser()
    openloop.add_arguments(parser)
    policy = json.dumps({"mode": "auto", "strategy": "threshold", "switch_up": 8})
    args = parser.parse_args(["--router-env", json.dumps({"SPECROUTER_POLICY": policy})])
    args.seed, args.out, args.quick, args.no_progress = 7, None, False, True
    assert openloop.settings_from_args(args).router_env == {"SPECROUTER_POLICY": policy}
    args = parser.parse_args([])
    args.seed, args.out, args.quick, args.no_progress = 7, None, False, True
    assert openloop.settings_from_args(args).router_env == {}
