"""`python -m loadtest.bench --report docs/benchmarks.md [--quick]`: every scenario, then
the Markdown report and its plots (in an `img/` folder next to the report).

The full run takes about 85 minutes on 2 cores (69.5 on 2026-12-04: sweep 10, open loop
25.5 at 100 requests per rate, agentic 18, the two traces 11.5, overhead and peer 4.5;
peer alone took 5.2 on 2026-12-06 with two floors, 6.2 with three; agentic-stream,
added later, 14.8 on 2026-12-07);
`--quick` is a smoke version of the same pipeline in under three minutes.
Raw results (JSON per scenario, CSV per request) go to `--results` (default: a fresh
temp folder, printed at the end) so the repository only holds the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest import hostcpu, plots, report
from loadtest.metrics import write_json
from loadtest.scenarios import agentic, connect_burst, openloop, overhead, peer, sweep, trace

SCENARIOS = ("sweep", "trace", "accept-shift", "openloop", "agentic", "agentic-stream",
             "overhead", "overhead-eagle", "overhead-pools", "peer", "connect-burst")

# Per-profile simulator time scale of the sweep: h200-llama3-8b relays ~5,000 chunks/s at
# concurrency 64 at time scale 1; at 0.1 that would be 50,000/s, far beyond 2 cores.
SWEEP_TIME_SCALES = {"seed-coding": 0.1, "h200-llama3-8b": 1.0}
TRACE_TIME_SCALE = 0.5
# real seconds per level of `specrouter calibrate` (its default is 20; shorter keeps
# `make bench` within the hour, and the crossover needs only the ordering of the pools)
CALIBRATE_DURATION_S = 5.0
ROUTER_CONFIGS = ["eagle", "baseline", "router", "router-goodput"]
AGENTIC_ROUTER_RUNS = 3

# The phased traces of the report: (scenario name, result key, settings).
TRACES: dict[str, dict[str, Any]] = {
    "trace": {
        "trace": "burst-open", "profile": "h200-llama3-8b",
        "configs": ["eagle", "baseline", "router", "router-goodput"],
        "slo_ttft_s": 2.0, "slo_tpot_s": 0.004, "alt_slo_ttft_s": 2.0, "alt_slo_tpot_s": 0.02,
        "note": (
            "Interactive coding on an 8B model: SLO TTFT <= 2 s and TPOT <= 4 ms "
            "(>= 250 tokens/s per stream). EAGLE-3 meets it at low load (TPOT ~2.9 ms at "
            "2-3 requests in the group), the baseline never does (~5.1-5.5 ms at any "
            "load). Low phases: 3 req/s Poisson (about 2-3 requests in the group). Burst: "
            "17 req/s Poisson for 60 s, above EAGLE-3's capacity alone (~14 req/s: "
            "closed-loop c=64 sweep, 48-request batch cap, prefill included) and below the "
            "baseline's (~19 req/s at large batches). Under this SLO no pool meets TPOT "
            "4 ms during the burst itself (the GPU runs 50+ requests per step); the burst "
            "decides what the pools do to the low phase after it. The second SLO (TTFT "
            "<= 2 s, TPOT <= 20 ms) counts the burst's tokens too."),
    },
    "accept-shift": {
        "trace": "accept-shift-c24", "profile": "h200-llama3-8b",
        "configs": [*ROUTER_CONFIGS, "router-goodput-noprobe"],
        "slo_ttft_s": 2.0, "slo_tpot_s": 0.010,
        "note": (
            "Steady closed loop of 24 users; the EAGLE engine's accept length goes 3.0 -> "
            "1.6 -> 3.0 (POST /sim/control accept_length at each phase start). The "
            "profile's cost model puts the crossover at 61.6 requests at accept 3.0 and "
            "12.4 at 1.6, so at 24 the better pool flips: EAGLE-3 ~1.5x ahead at 3.0, "
            "the baseline ~1.2x ahead at 1.6. `router` is the threshold policy that "
            "`specrouter calibrate` derives with accept length 3.0 in force (the first "
            "phase); `router-goodput` is the goodput strategy with the profile's cost "
            "model, re-measuring the idle EAGLE server's accept length with a shadow probe "
            "(a copy of a routed request cut to 128 tokens, answer discarded) at most "
            "every 30 s while it holds the group on the baseline (goodput_probe_s); "
            "`router-goodput-noprobe` the same without probes. SLO TTFT <= "
            "2 s, TPOT <= 10 ms (100 tokens/s per stream): the baseline meets it at 24 "
            "users (~7 ms), EAGLE-3 at accept 3.0 too (~4-5 ms), EAGLE-3 at accept 1.6 "
            "mostly not (~9-12 ms with prefills interleaved)."),
    },
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sweep_settings(args: argparse.Namespace, out: Path) -> sweep.SweepSettings:
    s = sweep.SweepSettings(time_scale=args.time_scale, progress=False, out_dir=str(out),
                            profile_time_scales=dict(SWEEP_TIME_SCALES),
                            configs=list(sweep.CONFIGS),
                            calibrate_duration_s=CALIBRATE_DURATION_S)
    if args.quick:
        s.profiles, s.levels, s.rounds, s.min_requests = ["seed-coding"], [1, 16], 1, 4
        s.output_tokens, s.input_tokens, s.calibrate_duration_s = 64, 500, 1.0
    return s


def trace_settings(args: argparse.Namespace, out: Path, name: str) -> trace.TraceSettings:
    spec = {"configs": list(ROUTER_CONFIGS), **TRACES[name]}
    s = trace.TraceSettings(**spec, time_scale=TRACE_TIME_SCALE, progress=False,
                            out_dir=str(out), bin_s=5.0,
                            calibrate_duration_s=CALIBRATE_DURATION_S,
                            calibrate_levels=[1, 4, 16, 32, 48, 64])
    if args.quick:
        s.length_factor, s.output_tokens, s.input_tokens, s.bin_s = 0.1, 64, 500, 2.0
        s.calibrate_levels, s.calibrate_duration_s = [1, 16], 1.0
        s.profile, s.time_scale = "seed-coding", 0.1
    return s


def openloop_settings(args: argparse.Namespace, out: Path) -> openloop.OpenLoopSettings:
    s = openloop.OpenLoopSettings(progress=False, out_dir=str(out),
                                  calibrate_duration_s=CALIBRATE_DURATION_S)
    return openloop.quick(s) if args.quick else s


def agentic_settings(args: argparse.Namespace, out: Path,
                     stream: bool = False) -> agentic.AgenticSettings:
    """The agentic scenario's settings; `stream`: sessions arriving for minutes
    (`agentic.stream`), its files in a folder of their own. The burst's `router`, the
    config its verdicts judge, runs `AGENTIC_ROUTER_RUNS` times and is judged by its
    median run: its cells at saturating rates differ more from run to run than the
    targets' margins (docs/policy.md section 5b)."""
    s = agentic.AgenticSettings(out_dir=str(out / "agentic-stream" if stream else out))
    if stream:
        s = agentic.stream(s)
    else:
        s.config_repeats = {"router": AGENTIC_ROUTER_RUNS}
    return agentic.quick(s) if args.quick else s


# The EAGLE-3 regime is a light load: a group holds a few requests below its crossover.
EAGLE_REGIME_STREAMS = 8


def overhead_settings(args: argparse.Namespace, out: Path,
                      servers: str = overhead.ONE_SERVER) -> overhead.OverheadSettings:
    s = overhead.OverheadSettings(out_dir=str(out), servers=servers)
    if servers != overhead.ONE_SERVER:
        s.rates = False
    if servers == overhead.EAGLE_REGIME:
        s.concurrency = EAGLE_REGIME_STREAMS
    if args.quick:
        s.concurrency, s.rounds, s.seconds, s.rate_seconds, s.rate_concurrency = (
            20, 1, 1.5, 1.5, 32)
    return s


def _guarded(name: str, job: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Run one scenario; a failure is logged and leaves the others (and the report) intact."""
    started, cpu_before = time.monotonic(), hostcpu.CpuTimes.read()
    log(f"== {name}")
    try:
        result = job()
    except Exception:
        log(f"{name} FAILED:\n{traceback.format_exc()}")
        return None
    host = hostcpu.shares(cpu_before, hostcpu.CpuTimes.read())
    log(f"== {name} done in {time.monotonic() - started:.0f} s"
        + (f" (host CPU: {hostcpu.describe(host)})" if host else ""))
    if host is not None:
        result[hostcpu.RESULT_KEY] = host
    return result


def run_all(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    wanted = set(args.only.split(",")) if args.only else set(SCENARIOS)
    results: dict[str, Any] = {}
    jobs: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
        ("sweep", "sweep", lambda: sweep.run_sweep(sweep_settings(args, out), log)),
        *((name, f"trace:{spec['trace']}",
           lambda name=name: trace.run_trace(trace_settings(args, out, name), log))
          for name, spec in TRACES.items()),
        ("openloop", "openloop",
         lambda: openloop.run_openloop(openloop_settings(args, out), log)),
        ("agentic", "agentic", lambda: agentic.run_agentic(agentic_settings(args, out), log)),
        ("agentic-stream", "agentic-stream",
         lambda: agentic.run_agentic(agentic_settings(args, out, stream=True), log)),
        ("overhead", "overhead",
         lambda: {"scenario": "overhead", **overhead.measure(overhead_settings(args, out))}),
        ("overhead-eagle", "overhead-eagle",
         lambda: {"scenario": "overhead", **overhead.measure(
             overhead_settings(args, out, overhead.EAGLE_REGIME))}),
        ("overhead-pools", "overhead-pools",
         lambda: {"scenario": "overhead", **overhead.measure(
             overhead_settings(args, out, overhead.TWO_POOLS))}),
        ("peer", "peer", lambda: _peer(args, out)),
        ("connect-burst", "connect-burst", lambda: connect_burst.run(_burst_settings(args))),
    ]
    for name, key, job in jobs:
        if name in wanted:
            result = _guarded(name, job)
            if result is not None:
                results[key] = result
                write_json(out / f"{key.replace(':', '-')}.json", result)
    return results


def _peer(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    s = overhead_settings(args, out)
    if not args.quick:  # 3 levels x 5 paths: about 5 minutes
        s.rounds, s.seconds, s.rate_seconds = 2, 4.0, 3.0
    return peer.side_by_side(s)


def _burst_settings(args: argparse.Namespace) -> connect_burst.BurstSettings:
    s = connect_burst.BurstSettings()
    return connect_burst.quick(s) if args.quick else s


def _merge_meta(out: Path, command: str, started: str, commit: str,
                elapsed_s: float) -> dict[str, Any]:
    """When / on what / by which commands the results in `out` were measured: the time
    and commit a run started at (code landing during a run is not what it measured). A
    second run into the same folder (e.g. `--only trace`) adds its command and time."""
    path = out / "meta.json"
    meta: dict[str, Any] = (json.loads(path.read_text(encoding="utf-8")) if path.is_file()
                            else {"started": started, "commands": [], "elapsed_s": 0.0,
                                  "commit": ""})
    if meta["commit"] and meta["commit"] != commit:
        commit = f"{meta['commit']}, then {commit}"
    meta.update(commit=commit, elapsed_s=float(meta["elapsed_s"]) + elapsed_s,
                commands=[*meta["commands"], command])
    write_json(path, meta)
    return meta


def load_results(folder: Path) -> dict[str, Any]:
    """The scenario results a previous run wrote (same keys as `run_all`)."""
    results: dict[str, Any] = {}
    keys = ["sweep", *(f"trace:{spec['trace']}" for spec in TRACES.values()), "openloop",
            "agentic", "agentic-stream", "overhead", "overhead-eagle", "overhead-pools", "peer",
            "connect-burst"]
    for key in keys:
        path = folder / f"{key.replace(':', '-')}.json"
        if path.is_file():
            results[key] = json.loads(path.read_text(encoding="utf-8"))
    return results


def make_plots(results: dict[str, Any], img_dir: Path, report_dir: Path) -> dict[str, str]:
    images: dict[str, str] = {}
    if "sweep" in results:
        for profile, configs in results["sweep"]["profiles"].items():
            path = plots.sweep_plot(profile, configs, img_dir / f"sweep-{profile}.png")
            images[profile] = str(path.relative_to(report_dir))
    for profile, data in results.get("openloop", {}).get("profiles", {}).items():
        path = plots.openloop_plot(profile, data, img_dir / f"openloop-{profile}.png")
        images[f"openloop:{profile}"] = str(path.relative_to(report_dir))
    for key in report.AGENTIC_SECTIONS:
        for profile, levels in results.get(key, {}).get("profiles", {}).items():
            path = plots.agentic_plot(profile, levels, img_dir / f"{key}-{profile}.png")
            images[f"{key}:{profile}"] = str(path.relative_to(report_dir))
    for key, value in results.items():
        if key.startswith("trace:"):
            path = plots.trace_plot(value, img_dir / f"trace-{key.split(':', 1)[1]}.png")
            images[key] = str(path.relative_to(report_dir))
    return images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__)
    parser.add_argument("--report", default="docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="fast smoke version")
    parser.add_argument("--results", help="folder for raw JSON/CSV (default: a temp folder)")
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="simulator --time-scale of the sweep and traces")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--from-results", metavar="DIR",
                        help="re-render the report and plots from a previous run's --results")
    parser.add_argument("--status", default="",
                        help="a status line printed at the top of the report")
    args = parser.parse_args(argv)
    out = Path(args.results or tempfile.mkdtemp(prefix="specrouter-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        folder = Path(args.from_results)
        results = load_results(folder)
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    else:
        command = "python -m loadtest.bench " + " ".join(sys.argv[1:] if argv is None else argv)
        started, commit = datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), report.git_commit()
        began = time.monotonic()
        results = run_all(args, out)
        meta = _merge_meta(out, command, started, commit, time.monotonic() - began)
        results = {**load_results(out), **results}
    report_path = Path(args.report)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    images = make_plots(results, report_path.parent / "img", report_path.parent)
    text = report.render(results, images, [str(c) for c in meta["commands"]], args.status,
                         str(meta["started"]), float(meta["elapsed_s"]), str(meta["commit"]))
    report_path.write_text(text, encoding="utf-8")
    log(f"wrote {report_path} (raw results in {out})")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
