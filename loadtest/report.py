"""The Markdown benchmark report, from the scenarios' result dictionaries.

Every number in it comes from the results passed in; each section names the command
that produced it, and every target is checked, saying by how much a miss missed.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from loadtest import hostcpu
from loadtest.scenarios import connect_burst, openloop
from loadtest.scenarios.overhead import P50_TARGET_MS, P99_TARGET_MS, side_by_side_lines
from loadtest.scenarios.sweep import LATENCY_TARGET, THROUGHPUT_TARGET
from loadtest.scenarios.trace import GOODPUT_TARGET

REPO_ROOT = Path(__file__).resolve().parent.parent


def machine() -> str:
    model, cores = "unknown CPU", 0
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("processor"):
                    cores += 1
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return (f"{model}, {cores} logical cores in /proc/cpuinfo ({usable} usable), "
            f"Python {platform.python_version()}, {platform.system()} {platform.release()}")


def host_cpu_lines(results: dict[str, Any]) -> list[str]:
    """The host's CPU time while each scenario ran (`loadtest.hostcpu`), where recorded."""
    runs = [f"{key} {hostcpu.describe(result[hostcpu.RESULT_KEY])}"
            for key, result in results.items() if hostcpu.RESULT_KEY in result]
    if not runs:
        return []
    return ["- Host CPU while each scenario ran (a share stolen by the hypervisor, or idle "
            "under a load meant to fill the cores, makes that scenario's figures slower and "
            "noisier than the code): " + "; ".join(runs)]


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "specrouter", "loadtest")
    return commit + (" (with uncommitted changes in specrouter/ or loadtest/)" if dirty else "")


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _check(ok: bool | None, text: str) -> str:
    return "n/a" if ok is None else ("met" if ok else f"**missed** ({text})")


ROUTER_LABELS = {
    "router": "specrouter (calibrated threshold, default settings)",
    "router-w0": "specrouter, arrival window off (admission.arrival_window_ms=0)",
    "router-goodput": ("specrouter, strategy goodput with the profile's cost model, "
                       "re-measuring the idle EAGLE server's accept length with a shadow "
                       "probe (a copy of a routed request cut to 128 tokens) at most every "
                       "30 s when it could matter (goodput_probe_s, scaled like the other "
                       "timers)"),
    "router-goodput-noprobe": "the same goodput router without probes (goodput_probe_s=0)",
}
# Configs whose sweep misses are target misses: the product as shipped (issues 4/6) and
# the goodput strategy (issue 9's envelope). router-w0 answers a question, not a target.
TARGET_ROUTERS = ("router", "router-goodput")


def _pools(pools: dict[str, Any] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (pools or {}).items()) or "n/a"


def _sweep_misses(profile: str, c: int, name: str, r: dict[str, Any]) -> list[str]:
    out = []
    if not r["meets_throughput"]:
        out.append(f"sweep {profile} c={c} {name}: throughput {r['throughput_ratio']:.3f}x "
                   f"the better pool (target {THROUGHPUT_TARGET}x, short by "
                   f"{THROUGHPUT_TARGET - r['throughput_ratio']:.3f})")
    if not r["meets_latency"]:
        out.append(f"sweep {profile} c={c} {name}: median latency {r['latency_ratio']:.3f}x "
                   f"the better pool (target {LATENCY_TARGET}x, over by "
                   f"{r['latency_ratio'] - LATENCY_TARGET:.3f})")
    return out


def _calibration_lines(cal: dict[str, Any] | None) -> list[str]:
    if not cal:
        return []
    if cal.get("error"):
        return [f"`specrouter calibrate` failed: `{cal['error'].splitlines()[-1][:200]}`", ""]
    cross = cal.get("crossover")
    where = (f" (at --time-scale {cal['time_scale']:g})" if cal.get("time_scale") else "")
    if cal.get("reused"):
        where += f", the calibration run for `{cal.get('tag')}` above, reused,"
    return [f"Calibration: `{cal['command']}`{where} measured the crossover at "
            f"{_f(cross, 2) if cross is not None else 'none (EAGLE-3 ahead at every level)'}"
            f" concurrent requests (EAGLE-3 accept length {_f(cal.get('accept_length'), 2)})"
            f" and wrote the policy `{cal['policy']}`, applied to every router config "
            "(SPECROUTER_POLICY).", ""]


def sweep_section(sweep: dict[str, Any], images: dict[str, str]) -> tuple[list[str], list[str]]:
    lines: list[str] = []
    misses: list[str] = []
    s = sweep["settings"]
    scales = sweep.get("time_scales", {})
    scale_text = ", ".join(f"{p} {v:g}" for p, v in scales.items()) or str(s["time_scale"])
    lines += ["## Sweep: closed-loop concurrency", "",
              f"Profiles {', '.join(s['profiles'])}; {s['input_tokens']} input tokens "
              f"(4 characters per token), {s['output_tokens']} output tokens (ignore_eos); "
              f"requests per level max({s['rounds']} x concurrency, {s['min_requests']}), "
              "every level starting from an idle group and from the same simulator seed "
              "(POST /sim/control seed: every config sees the same random draws); "
              f"simulator --time-scale per profile: {scale_text}; all times below are "
              "simulated seconds. eagle-only and baseline-only go directly to that engine of "
              "the shared-GPU group (the other engine idles). The router configs go through "
              "`specrouter serve` after `specrouter calibrate` ran on the same group: "
              + "; ".join(f"`{k}`: {v}" for k, v in ROUTER_LABELS.items()) + ". "
              "The router's timers are scaled to the simulator's clock: telemetry poll "
              "0.1 s x time scale (SPECROUTER_TELEMETRY__INTERVAL_S; an idle server's 1 s "
              "x time scale, SPECROUTER_TELEMETRY__IDLE_INTERVAL_S), health checks 2 s x "
              "time scale (SPECROUTER_HEALTH__INTERVAL_S), goodput dwell 1 s x time scale "
              "(policy goodput_min_dwell_s); the arrival window stays in real ms (it is "
              "about how far apart requests reach the router, which the simulated clock "
              "does not change).", "",
              f"Targets: router throughput >= {THROUGHPUT_TARGET}x and median latency <= "
              f"{LATENCY_TARGET}x the better static pool, at every level.", ""]
    for profile, configs in sweep["profiles"].items():
        lines += [f"### {profile}", ""]
        lines += _calibration_lines(sweep.get("calibration", {}).get(profile))
        if profile in images:
            lines += [f"![sweep {profile}]({images[profile]})", ""]
        levels = {c: {lv["concurrency"]: lv for lv in d.get("levels", [])}
                  for c, d in configs.items()}
        comparison = {row["concurrency"]: row for row in sweep["comparison"].get(profile, [])}
        routers = [c for c in configs if c.startswith("router") and levels.get(c)]
        head = ["concurrency", "eagle tok/s", "baseline tok/s", "router tok/s",
                "eagle p50 s", "baseline p50 s", "router p50 s"]
        head += [f"{r} tok/s ratio / p50 ratio" for r in routers]
        head += ["router pools"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c, row in sorted(comparison.items()):
            e = levels.get("eagle", {}).get(c)
            b = levels.get("baseline", {}).get(c)
            r = levels.get("router", {}).get(c)
            cells = [str(c), _f(e and e["output_tok_s"]), _f(b and b["output_tok_s"]),
                     _f(r and r["output_tok_s"]), _f(e and e["e2e"]["p50"], 2),
                     _f(b and b["e2e"]["p50"], 2), _f(r and r["e2e"]["p50"], 2)]
            for name in routers:
                v = row.get("routers", {}).get(name)
                if v is None:
                    cells.append("n/a")
                    continue
                mark = "" if v["meets_throughput"] and v["meets_latency"] else " **x**"
                cells.append(f"{v['throughput_ratio']:.3f} / {v['latency_ratio']:.3f}{mark}")
                if name in TARGET_ROUTERS:
                    misses += _sweep_misses(profile, c, name, v)
            cells.append(_pools(row.get("routers", {}).get("router", {}).get("pools")))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Ratios are router / better static pool (throughput: higher is better, "
                  "target >= 0.97; p50: lower is better, target <= 1.05); **x** marks a "
                  "miss.", ""]
        for config, data in configs.items():
            if data.get("error"):
                lines += [f"{config}: could not run: `{data['error'].splitlines()[-1][:200]}`",
                          ""]
            if data.get("decisions"):
                text = ", ".join(f"{k} {v:.0f}" for k, v in sorted(data["decisions"].items()))
                lines += [f"{config} decisions over the sweep (pool/reason): {text}.", ""]
        lines += _cpu_note(configs)
    return lines, misses


def _cpu_note(configs: dict[str, Any]) -> list[str]:
    peaks: dict[str, float] = {}
    flagged: list[str] = []
    for config, data in configs.items():
        for lv in data.get("levels", []):
            for name, share in lv.get("cpu_cores", {}).items():
                peaks[name] = max(peaks.get(name, 0.0), share)
            if lv.get("saturated"):
                flagged.append(f"{config} c={lv['concurrency']} ({', '.join(lv['saturated'])})")
    text = ", ".join(f"{name} {share:.2f}" for name, share in sorted(peaks.items()))
    line = f"Peak CPU use per process, in cores (does the simulator keep up?): {text}."
    if flagged:
        line += " Near a full core at: " + "; ".join(flagged) + " (timings there are suspect)."
    else:
        line += " No process came near a full core, so the simulator kept its clock."
    return [line, ""]


def trace_section(trace: dict[str, Any], image: str | None) -> tuple[list[str], list[str]]:
    s = trace["settings"]
    phases = ", ".join(
        f"{p['name']} {p['duration_s']:g} s at "
        + (f"concurrency {p['concurrency']}" if p["concurrency"] is not None
           else f"{p['rate']:g} req/s (Poisson)")
        + (f" with {p['control']}" if p.get("control") else "")
        for p in trace["phases"])
    alt = s.get("alt_slo_tpot_s")
    lines = [f"## Trace `{s['trace']}` ({s['profile']})", "",
             f"Phases: {phases}. Simulator --time-scale {s['time_scale']:g} (times are "
             f"simulated seconds). SLO: TTFT <= {s['slo_ttft_s']:g} s and TPOT <= "
             f"{s['slo_tpot_s'] * 1e3:g} ms; goodput = output tokens of requests meeting "
             "both, per second of the whole run (simulated time)."
             + (f" Second SLO: TTFT <= {s['alt_slo_ttft_s']:g} s and TPOT <= "
                f"{alt * 1e3:g} ms." if alt else ""), ""]
    if s.get("note"):
        lines += [f"Why these values: {s['note']}", ""]
    lines += _calibration_lines(trace.get("calibration"))
    if image:
        lines += [f"![trace {s['trace']}]({image})", ""]
    phase_names = [p["name"] for p in trace["phases"]]
    head = ["config", "goodput tok/s", "throughput tok/s", "SLO met"]
    head += ["goodput, second SLO"] if alt else []
    head += [f"{n} goodput" for n in phase_names]
    head += ["e2e p50 s", "TTFT p99 s", "errors"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config, data in trace["configs"].items():
        if "summary" not in data:
            lines.append(f"| {config} | could not run |" + " |" * (len(head) - 2))
            continue
        m = data["summary"]
        cells = [config, _f(m["goodput_tok_s"]), _f(m["output_tok_s"]),
                 f"{m['slo_met']}/{m['requests']}"]
        if alt:
            a = m.get("alt", {})
            cells.append(f"{_f(a.get('goodput_tok_s'))} ({a.get('slo_met', 'n/a')} met)")
        cells += [_f(data.get("phases", {}).get(n, {}).get("goodput_tok_s"))
                  for n in phase_names]
        cells += [_f(m["e2e"]["p50"], 2), _f(m["ttft"]["p99"], 2), str(m["errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Phase goodput: tokens of that phase's requests meeting the SLO over the "
              "phase's own span (first start to last end, so a backlog that spills into the "
              "next phase stretches it).", ""]
    misses: list[str] = []
    cmp = trace["comparison"]
    for name, ratio in cmp.get("routers", {}).items():
        if ratio is None:
            continue
        ok = ratio >= GOODPUT_TARGET
        if s["trace"] == "accept-shift-c24":  # issue 9's target is the line below
            lines.append(f"- {name} goodput / best static pool ({cmp['best_static']}): "
                         f"**{ratio:.3f}x** (no target on this trace)")
            continue
        lines.append(f"- {name} goodput / best static pool ({cmp['best_static']}): "
                     f"**{ratio:.3f}x** (target >= {GOODPUT_TARGET}x: "
                     f"{_check(ok, f'short by {GOODPUT_TARGET - ratio:.3f}')})")
        if name == "router" and not ok and s["trace"] != "accept-shift-c24":
            misses.append(f"trace {s['trace']}: router goodput {ratio:.3f}x the best static "
                          f"pool (target {GOODPUT_TARGET}x, short by "
                          f"{GOODPUT_TARGET - ratio:.3f})")
    g = cmp.get("goodput_vs_threshold")
    if g is not None:
        ok = g > 1.0
        lines.append(f"- router-goodput / router (threshold calibrated on the first phase): "
                     f"**{g:.3f}x** (target > 1: {_check(ok, f'short by {1.0 - g:.3f}')})")
        if not ok:
            misses.append(f"trace {s['trace']}: goodput strategy {g:.3f}x the calibrated "
                          f"threshold router (target > 1)")
    lines.append("")
    for name, data in trace["configs"].items():
        events = data.get("switch_events")
        if events is None:
            continue
        shown = ", ".join(f"{e['t']:.0f} s -> {e['to']}" for e in events[:12])
        more = f" (and {len(events) - 12} more)" if len(events) > 12 else ""
        lines.append(f"- {name} switch events (pool of a new request differs from the "
                     f"previous request's): {len(events)}" + (f": {shown}{more}" if events
                                                              else ""))
        if data.get("decisions"):
            text = ", ".join(f"{k} {v:.0f}" for k, v in sorted(data["decisions"].items()))
            lines.append(f"  decisions (pool/reason): {text}; policy `{data.get('policy')}`")
        if data.get("saturated"):
            lines.append(f"  near a full core: {', '.join(data['saturated'])} (suspect)")
    lines.append("")
    return lines, misses


def openloop_section(result: dict[str, Any], images: dict[str, str]
                     ) -> tuple[list[str], list[str]]:
    s = result["settings"]
    lines = ["## Open loop: Poisson rates from light load to saturation, on/off bursts", "",
             f"Requests arrive on a schedule drawn before the run from fixed seeds, so every "
             "config gets the same requests at the same moments. Requests per Poisson rate: "
             f"at least {s['min_requests']}, and enough for the arrivals to last as long as "
             f"{s['saturation_requests']} take at the saturation rate (a loaded rate reaches "
             "its steady batch and queue); prompt lengths lognormal (median "
             f"{s['input_median']:g}, sigma {s['input_sigma']:g}, clipped to "
             f"[{s['input_low']}, {s['input_high']}] tokens), output lengths lognormal "
             f"(median {s['output_median']:g}, sigma {s['output_sigma']:g}, clipped to "
             f"[{s['output_low']}, {s['output_high']}]) with ignore_eos. Rates are fractions "
             f"{', '.join(f'{f:g}' for f in s['fractions'])} (per profile where its "
             "section says so) of the saturation rate: the "
             "requests/s the better pool alone completes with "
             f"{s['saturation_batch']} requests in its batch (the profile's cost model: decode "
             "throughput at that batch and the mean context; plus the profile's prefill cost "
             "per request at the mean prompt length). The burst pattern is on/off modulated "
             f"Poisson: {openloop.BURST_ON:g}x saturation for about {s['burst_on_arrivals']} "
             f"arrivals, then {openloop.BURST_OFF:g}x for about {s['burst_off_arrivals']}, "
             f"{s['burst_cycles']} cycles. Each load starts from an idle group, empty prefix "
             "caches and the same simulator seed; every request pastes a context of its own "
             "(no shared prefix). Configs: `eagle` / `baseline` (that engine of the group alone); "
             "`router`: `specrouter serve` with nothing set but the router's timers on the "
             "simulator's clock (what a new user gets); `router-calibrated`: what "
             "`specrouter calibrate` writes with its default strategy on the same group: the "
             "online strategy seeded with the cost model fitted from the sweep, served as "
             "`cost_model: {file: ...}`; `router-goodput`: strategy goodput with the "
             "profile's cost model on top of the calibrated threshold band. A router "
             "config runs every load in one process, lightest first. Simulator: the "
             "shared-GPU SGLang simulator (time-slicing: when both engines of the group have "
             "work, each step waits for the other's). Times are simulated seconds. The "
             "simulator runs 1 / time scale times faster than a GPU, and a client's time "
             "converted whole would count each real millisecond outside the engines (the "
             "router's request path, the HTTP hops) 1 / time scale times over, where a GPU "
             "deployment pays it once: `TTFT p99 s` is that whole conversion, `TTFT p99 "
             "deployed s` converts only the engines' part of each request (its stays in "
             "the engines before its first token, read from the simulator by request id: "
             "`loadtest.residence`) and keeps the rest at its real size; the TTFT target "
             "judges the deployed one, for every config alike.", "",
             f"Targets at every Poisson rate (done-when): router median e2e <= "
             f"{openloop.LATENCY_TARGET}x, throughput >= {openloop.THROUGHPUT_TARGET}x, TTFT "
             f"p99 <= {openloop.TTFT_P99_TARGET}x the better static pool (the pool with the "
             "lower median e2e at that rate; throughput against the higher of the two), no "
             "errors; the calibrated config as well. The burst is reported against the same "
             "ratios, not judged. In parentheses, shown and not judged: the TTFT p99 against "
             "the lower of the two pools' (where EAGLE-3 is the better pool, its own TTFT "
             "p99 is above the baseline's: its draft model prefills too, so that ratio "
             "prices the pool the router chose, not the router).", ""]
    misses: list[str] = []
    for profile, data in result["profiles"].items():
        cap = data["capacity"]
        pools = cap["pools"]
        lines += [f"### {profile} (open loop)", "",
                  f"Simulator --time-scale {data['time_scale']:g}. Saturation "
                  f"{cap['saturation_req_s']:.3g} req/s ({cap['better']}): at batch "
                  f"{cap['batch']} and context {cap['ctx']} the cost model gives eagle "
                  f"{pools['eagle']['decode_tok_s']:g} tok/s decode (batch "
                  f"{pools['eagle']['batch']:g}, accept length {cap['accept_length']:g}), "
                  f"baseline {pools['baseline']['decode_tok_s']:g} tok/s; with prefill "
                  f"{pools['eagle']['prefill_ms']:g} / {pools['baseline']['prefill_ms']:g} ms "
                  f"per request and {cap['mean_output_tokens']:g} mean output tokens: eagle "
                  f"{pools['eagle']['req_s']:.3g} req/s, baseline "
                  f"{pools['baseline']['req_s']:.3g} req/s. Cost-model crossover "
                  f"{_f(cap.get('crossover'), 1)} requests. Poisson rates: "
                  + ", ".join(f"{ld['rate']:g} ({ld['requests']} requests)"
                              for ld in data["loads"] if ld["rate"] is not None)
                  + " req/s.", ""]
        lines += [line.replace("applied to every router config",
                               "applied to router-goodput; its fitted cost model "
                               "(`--write-cost-model`) seeds router-calibrated")
                  for line in _calibration_lines(data.get("calibration"))]
        if f"openloop:{profile}" in images:
            lines += [f"![open loop {profile}]({images[f'openloop:{profile}']})", ""]
        lines += ["| load | config | offered req/s | e2e p50 s | e2e p99 s | TTFT p99 s | "
                  "TTFT p99 deployed s | tok/s | errors | pools |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        burst = cap.get("burst") or {}
        burst_rate = (f"on {_f(burst.get('on_rate'), 3)} / off {_f(burst.get('off_rate'), 3)}"
                      if burst else "n/a")
        for ld in data["loads"]:
            for config, cfg in data["configs"].items():
                row = next((r for r in cfg.get("loads", []) if r["load"] == ld["name"]), None)
                if row is None:
                    continue
                rate = ld["rate"]
                lines.append(
                    f"| {ld['name']} | {config} | "
                    f"{_f(rate, 3) if rate is not None else burst_rate} | "
                    f"{_f(row['e2e']['p50'], 2)} | {_f(row['e2e']['p99'], 2)} | "
                    f"{_f(row['ttft']['p99'], 3)} | "
                    f"{_f(row.get('ttft_deployed', {}).get('p99'), 3)} | "
                    f"{_f(row['output_tok_s'])} | {row['errors']} | "
                    f"{_pools(row.get('by_pool'))} |")
        cmp = result["comparison"].get(profile, {})
        routers = [c for c in data["configs"] if c not in openloop.STATIC]
        head = ["load", "better static pool: tok/s / p50 s / TTFT p99 deployed s (lower "
                "TTFT p99)"]
        head += [f"{r}: p50 / tok/s / TTFT p99 deployed ratio (vs the lower)" for r in routers]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in cmp.get("rows", []):
            best = row.get("best")
            cells = [row["load"], "n/a" if best is None else
                     f"{best['pool']}: {_f(best['output_tok_s'])} / {_f(best['e2e_p50'], 2)} / "
                     f"{_f(best['ttft_p99'], 3)} ({_f(best['ttft_p99_lowest'], 3)})"]
            for name in routers:
                v = row["routers"].get(name)
                if v is None:
                    cells.append("n/a")
                    continue
                mark = "" if v["meets"] else " **x**"
                cells.append(f"{_f(v['latency_ratio'], 3)} / {_f(v['throughput_ratio'], 3)} / "
                             f"{_f(v['ttft_p99_ratio'], 3)} "
                             f"({_f(v['ttft_p99_ratio_lowest'], 3)}){mark}")
                if name in openloop.JUDGED and row["rate"] is not None and not v["meets"]:
                    misses.append(f"openloop {profile} {row['load']} req/s {name}: "
                                  + _openloop_miss(v, data["time_scale"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Ratios are config / better static pool at the same load; **x** marks a "
                  "miss of any target (or errors).", ""]
        for name, v in cmp.get("verdict", {}).items():
            judged = " (done-when)" if name in openloop.JUDGED else ""
            lines.append(f"- {name}{judged}: met every target at {v['met']} of {v['rates']} "
                         f"Poisson rates: **{'met' if v['meets_all'] else 'missed'}**")
        lines.append("")
        for config, cfg in data["configs"].items():
            if cfg.get("error"):
                lines += [f"{config}: could not run: `{cfg['error'].splitlines()[-1][:200]}`",
                          ""]
            if cfg.get("decisions"):
                text = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cfg["decisions"].items()))
                lines += [f"{config} decisions over all loads (pool/reason): {text}.", ""]
        peaks: dict[str, float] = {}
        flagged: list[str] = []
        for config, cfg in data["configs"].items():
            for row in cfg.get("loads", []):
                for name, share in row.get("cpu_cores", {}).items():
                    peaks[name] = max(peaks.get(name, 0.0), share)
                if row.get("saturated"):
                    flagged.append(f"{config} {row['load']} ({', '.join(row['saturated'])})")
        line = ("Peak CPU per process, in cores: "
                + ", ".join(f"{n} {v:.2f}" for n, v in sorted(peaks.items())) + ".")
        line += (" Near a full core at: " + "; ".join(flagged) + " (timings there are suspect)."
                 if flagged else " No process came near a full core.")
        lines += [line, ""]
    return lines, misses


def _openloop_miss(v: dict[str, Any], time_scale: float) -> str:
    parts = []
    if not v["meets_latency"]:
        parts.append(f"median e2e {_f(v['latency_ratio'], 3)}x (target <= "
                     f"{openloop.LATENCY_TARGET}x)")
    if not v["meets_throughput"]:
        parts.append(f"throughput {_f(v['throughput_ratio'], 3)}x (target >= "
                     f"{openloop.THROUGHPUT_TARGET}x)")
    if not v["meets_ttft"]:
        excess = v.get("ttft_p99_excess_s")
        real = ("" if excess is None else f", +{excess * 1e3:.1f} ms" if v.get("ttft_deployed")
                else f", +{excess * time_scale * 1e3:.1f} ms in real time")
        parts.append(f"TTFT p99 {_f(v['ttft_p99_ratio'], 3)}x (target <= "
                     f"{openloop.TTFT_P99_TARGET}x{real})")
    if v["errors"]:
        parts.append(f"{v['errors']} errors")
    return "; ".join(parts) + " the better static pool"


def overhead_section(overhead: dict[str, Any] | None, peer: dict[str, Any] | None,
                     eagle_regime: dict[str, Any] | None = None,
                     two_pools: dict[str, Any] | None = None
                     ) -> tuple[list[str], list[str]]:
    lines = ["## Overhead: router vs direct, and a peer router", "",
             "One simulated engine (the seed-coding baseline engine with zero prefill cost "
             "at --time-scale 0.25; with truly zero step cost 100 closed-loop streams "
             "saturate 2 cores and every path measures CPU queueing), 100 closed-loop "
             "streaming chat completions of 16 tokens with a random pause (mean 20 ms) "
             "between a user's requests, phases alternating direct / through the router so "
             "host drift cancels; latency percentiles over the requests started after each "
             "phase's first 0.5 s (a phase starts all its users at once, a burst that "
             "queues behind itself). TTFT = first content chunk; TTFB = response headers, which "
             "the engine sends at once, so added TTFB is the proxy's request-path cost "
             "without the engine's decode-step quantization. CPU per request is user + "
             "system time of the router process "
             "(and its children) from /proc over the routed phases. Max rate: 1-token "
             "streams at high concurrency; the CPU column says whether the router was the "
             "bottleneck (near 1 core per worker) or the simulator/load generator was (then "
             "the rate is a lower bound; the CPU-bound column is 1 / CPU s per request). "
             "The default row has the engine as the router's only server, the proxy path "
             "a group in the baseline regime takes (nothing waits). The EAGLE-3 regime row "
             "gives the router the group's other engine as a baseline server and a policy "
             "that keeps the group on EAGLE-3, at a light load: each request then waits the "
             "arrival window (a quiet 2 ms gap, at most 16 ms) before its decision, so that "
             "row is what the window costs a request sent to EAGLE-3. The two-pool row is a "
             "group as `serve` runs it: the group's EAGLE-3 and baseline engines under the "
             "default policy (the online strategy decides every request; at 100 streams "
             "the group is in the baseline regime, and direct goes to the baseline engine). "
             "The targets (p50 < 1 "
             "ms, p99 < 5 ms at 100 streams) are checked on the default row.", ""]
    misses: list[str] = []
    rows: list[tuple[str, dict[str, Any]]] = []
    if overhead:
        rows.append(("specrouter (default settings)", overhead))
    if eagle_regime:
        rows.append(("specrouter, two pools in the EAGLE-3 regime (arrival window waits)",
                     eagle_regime))
    if two_pools:
        pools = (two_pools.get("summary") or {}).get("router_pools") or {}
        split = ", ".join(f"{n} {p}" for p, n in sorted(pools.items()))
        rows.append((f"specrouter, two pools, default policy ({split or 'pools not known'})",
                     two_pools))
    if peer and not peer.get("levels"):
        rows.append((peer.get("peer", "peer") + f" {peer.get('version', '')}", peer))
    lines += ["| router | streams | added TTFT p50 ms | added TTFT p99 ms | added TTFB p50 ms"
              " | added TTFB p99 ms | direct TTFT p50 ms | router CPU ms/request | max req/s "
              "(1 worker) | its CPU cores | CPU-bound req/s per core | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, data in rows:
        if not data.get("summary"):
            lines.append(f"| {name} | not measured: {data.get('why', 'no result')} "
                         "| | | | | | | | | | |")
            continue
        m, rate = data["summary"], data.get("rate_1_worker", {})
        cores = rate.get("cpu_cores", {}).get("target")
        lines.append(
            f"| {name} | {m['concurrency']} | {_f(m['added_p50_ms'], 3)} | "
            f"{_f(m['added_p99_ms'], 3)} | {_f(m.get('added_ttfb_p50_ms'), 3)} | "
            f"{_f(m.get('added_ttfb_p99_ms'), 3)} | {_f(m['ttft_p50_direct_ms'], 3)} | "
            f"{_f(m['router_cpu_ms_per_request'], 3)} | {_f(rate.get('req_s'))} | "
            f"{_f(cores, 2)} | {_f(rate.get('cpu_bound_req_s_per_core'))} | "
            f"{m['errors_router']} |")
    lines.append("")
    if overhead and overhead.get("summary"):
        part, missed = _overhead_targets(overhead)
        lines += part
        misses += missed
    if peer and peer.get("levels"):  # the peer scenario: both routers in one run
        lines += side_by_side_lines(peer)
    return lines, misses


def _overhead_targets(overhead: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The default row against the added-latency targets, and the request rates."""
    m = overhead["summary"]
    over50 = f"over by {m['added_p50_ms'] - P50_TARGET_MS:.3f} ms"
    over99 = f"over by {m['added_p99_ms'] - P99_TARGET_MS:.3f} ms"
    lines = [f"specrouter (default settings) targets at {m['concurrency']} streams: added p50 < "
             f"{P50_TARGET_MS} ms: {_check(m['meets_p50'], over50)}; added p99 < "
             f"{P99_TARGET_MS} ms: {_check(m['meets_p99'], over99)}.", ""]
    misses = []
    if not m["meets_p50"]:
        misses.append(f"overhead: added TTFT p50 {m['added_p50_ms']:.3f} ms (target < "
                      f"{P50_TARGET_MS} ms, {over50})")
    if not m["meets_p99"]:
        misses.append(f"overhead: added TTFT p99 {m['added_p99_ms']:.3f} ms (target < "
                      f"{P99_TARGET_MS} ms, {over99})")
    direct = overhead.get("rate_direct", {})
    lines += [f"Direct to the simulator, the same rate test reached {_f(direct.get('req_s'))}"
              f" req/s (simulator at {_f(direct.get('cpu_cores', {}).get('target'), 2)} "
              "cores).", ""]
    multi = overhead.get("rate_n_workers", {})
    if multi.get("measured"):
        lines += [f"{multi['workers']} workers (`serve --workers {multi['workers']}`, "
                  f"Redis mode): {_f(multi['req_s'])} req/s, "
                  f"{_f(multi['cpu_cores'].get('target'), 2)} cores; 1 worker: "
                  f"{_f(overhead.get('rate_1_worker', {}).get('req_s'))} req/s.", ""]
    else:
        lines += [f"N workers: not measured ({multi.get('why', 'not run')}).", ""]
    return lines, misses


#: The verdict's goodput comparisons (loadtest/scenarios/agentic.py `verdict`), as the
#: report names them.
_AGENTIC_COMPARED = (("vs_best_static", "best static pool"),
                     ("vs_cache_aware", "sglang-router cache_aware"),
                     ("vs_adaptive", "adaptive engine"))

AGENTIC_LABELS = {
    "eagle": "EAGLE-3 servers only, each session pinned to one",
    "baseline": "baseline servers only, each session pinned to one",
    "router-noaffinity": "specrouter as a new user gets it (online strategy, cost learned "
                         "from telemetry, no calibration), affinity off",
    "router": "specrouter as a new user gets it (online strategy, cost learned from "
              "telemetry, no calibration), prefix/session affinity: the config the "
              "targets judge",
    "router-slo": "`router` told the SLO's TPOT limit (`affinity.tpot_slo_ms`): a group "
                  "whose sessions' servers answer within it keeps them",
    "router-goodput": "specrouter, goodput strategy with the profile's cost model, "
                      "prefix/session affinity",
    "sglang-cache_aware": "sglang-router --policy cache_aware over the 4 servers",
    "sglang-round_robin": "sglang-router --policy round_robin over the 4 servers",
    "adaptive": "one adaptive-speculation engine per GPU (whole memory), sessions pinned",
}


def _served_all(level: dict[str, Any] | None) -> str:
    """The note for a best static pool that met the SLO on every turn it was to send: its
    goodput is then the sessions' whole output over the run's span, which a faster
    server shortens only by the time it saves on the last turns, so no config can come
    near 1.2x of it ("" otherwise)."""
    if not level or "error" in level or level.get("unsent_turns"):
        return ""
    if level.get("slo_met") != level.get("requests"):
        return ""
    return (" (out of reach at this rate: the best static pool met the SLO on every turn, "
            "so its goodput is the sessions' whole output over the run's span)")


def _behind_adaptive(router: dict[str, Any] | None, adaptive: dict[str, Any] | None) -> str:
    """For a router behind the adaptive engine: the measured quantities that differ, and
    the structural difference behind them ("" without both results)."""
    if not router or not adaptive or "error" in router or "error" in adaptive:
        return ""

    def prefill(v: dict[str, Any]) -> str:
        tokens = (v.get("engines") or {}).get("prefill_tokens")
        return "n/a" if tokens is None else f"{tokens / 1e6:.2f}"

    def tpot_ms(v: dict[str, Any]) -> str:
        p90 = (v.get("tpot") or {}).get("p90")
        return "n/a" if p90 is None else f"{p90 * 1e3:.1f}"

    return (f" (measured beside it: cached share {_pct(router.get('cached_share'))} against "
            f"{_pct(adaptive.get('cached_share'))}, prefill {prefill(router)} against "
            f"{prefill(adaptive)} Mtok, TPOT p90 {tpot_ms(router)} against "
            f"{tpot_ms(adaptive)} ms: the adaptive engine keeps one cache of its GPU's "
            "whole memory and one batch, where the router's two servers split the memory "
            "into two caches and share the GPU's time)")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _agentic_check(name: str, check: dict[str, Any]) -> str:
    ratio = check.get("ratio")
    text = f"{_f(ratio, 2)}x (target {check['target']:g}x)"
    return f"{name} {text}: {_check(check.get('met'), 'below target')}"


#: The agentic scenario's results the report shows (bench result keys), in order, with
#: their headings and what sets each apart.
AGENTIC_SECTIONS: dict[str, tuple[str, str]] = {
    "agentic": ("Agentic multi-turn sessions", ""),
    "agentic-stream": (
        "Agentic sessions as a stream",
        "The sessions of the section above, arriving for minutes instead of 30 "
        "simulated s, so the live sessions reach their steady state: above, no session "
        "arrives after the 30th second, and the caches hold rates that a stream outgrows. "
        "Per profile a rate every pool sustains with its caches holding the sessions, and "
        "one past the knee where they outgrow the smaller caches (docs/policy.md section "
        "9, \"Sustained sessions\")."),
}


def _arrival_windows(s: dict[str, Any], profiles: list[str]) -> str:
    """Over how many simulated seconds sessions arrive, per profile where they differ."""
    windows = {p: (s.get("profile_window_s") or {}).get(p, s["window_s"]) for p in profiles}
    if len(set(windows.values())) <= 1:
        return f"{next(iter(windows.values()), s['window_s']):g} simulated s"
    return ", ".join(f"{w:g} simulated s ({p})" for p, w in windows.items())


def agentic_section(result: dict[str, Any], images: dict[str, str],
                    section: str = "agentic") -> tuple[list[str], list[str]]:
    """The agentic multi-turn trace (`section`, one of `AGENTIC_SECTIONS`): one table per
    profile and rate, then the checks."""
    s, shape = result["settings"], result["shape"]
    heading, lead = AGENTIC_SECTIONS[section]
    lines = [f"## {heading}", "", *([lead, ""] if lead else []),
             f"Sessions (`loadtest/agentic.py`): a shared system prompt with tool definitions "
             f"of {shape['system_tokens']} tokens, a repository context of "
             f"{shape['repo_tokens_min']}-{shape['repo_tokens_max']} tokens per session, "
             f"turns adding {shape['turn_tokens_min']}-{shape['turn_tokens_max']} tokens "
             f"(lognormal, median {shape['turn_tokens_median']:g}) plus the previous answer "
             f"resent as streamed, until the context passes "
             f"{shape['context_target_min']}-{shape['context_target_max']} tokens; answers "
             f"lognormal (median {shape['output_median']:g}, sigma {shape['output_sigma']:g}, "
             f"{shape['output_min']}-{shape['output_max']} tokens, ignore_eos); think time "
             f"lognormal (median {shape['think_median_s']:g} s) between an answer and the "
             f"next turn. Sessions arrive as a Poisson process over "
             f"{_arrival_windows(s, list(result['profiles']))} (open loop); each is closed "
             f"loop inside. Two GPU groups; every "
             f"config plays the same sessions, its rates lightest first on one set of "
             f"processes with every engine's prefix cache flushed between rates. Session "
             f"moves: turns sent to another server than the session's previous turn (from "
             f"x-specrouter-backend; n/a where the proxy does not say). Simulator flags: "
             f"{', '.join(result.get('sim_flags') or []) or 'none'} (cached tokens come "
             f"from usage.prompt_tokens_details.cached_tokens; prefill tokens from the "
             f"engines' /sim/state).", "",
             result.get("slo_note", ""), "",
             "The simulator runs 1/time-scale times faster than a GPU, but a proxy's own "
             "real time per request is not scaled: each real millisecond a router spends on "
             "a request shows as 1/time-scale simulated milliseconds of TTFT. The `TTFB p50 "
             "real ms` column (to the response headers, wall clock) shows that cost next to "
             "the engines' own. No turn starts later than "
             f"{s.get('drain_s', 60.0):g} simulated s after the arrival window; the turns left are "
             "counted as not sent.", "",
             *[f"- `{c}`: {AGENTIC_LABELS.get(c, c)}" for c in s["configs"]], ""]
    misses: list[str] = []
    for profile, levels in result["profiles"].items():
        scale = s["profile_time_scales"].get(profile, s["time_scale"])
        lines += [f"### {profile} (simulator time scale {scale:g})", ""]
        image = images.get(f"{section}:{profile}")
        if image:
            lines += [f"![{section} {profile}]({image})", ""]
        for lv in levels:
            lines += [f"Session arrival rate {lv['rate']:g}/s:", "",
                      "| config | goodput tok/s | output tok/s | turns in SLO | cached share "
                      "| prefill Mtok | TTFT p50 s | TTFT p99 s | TTFB p50 real ms "
                      "| session moves | turns not sent | CPU peak |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for config, v in lv["configs"].items():
                if "error" in v:
                    lines.append(f"| {config} | not measured: {v['error'][:120]} "
                                 "| | | | | | | | | | |")
                    continue
                prefill = (v.get("engines") or {}).get("prefill_tokens")
                moves = v.get("session_moves") or {}
                cpu = max((x for k, x in (v.get("cpu_cores") or {}).items()), default=0.0)
                runs = v.get("goodput_runs")
                spread = "" if not runs else " (runs " + " / ".join(_f(g) for g in runs) + ")"
                lines.append(
                    f"| {config} | {_f(v['goodput_tok_s'])}{spread} | {_f(v['output_tok_s'])} | "
                    f"{v['slo_met']}/{v['requests']} | {_pct(v.get('cached_share'))} | "
                    f"{_f(None if prefill is None else prefill / 1e6, 2)} | "
                    f"{_f(v['ttft']['p50'], 2)} | {_f(v['ttft']['p99'], 2)} | "
                    f"{_f(v['ttfb']['p50'] * scale * 1e3)} | "
                    f"{_pct(moves.get('share'))} | {v.get('unsent_turns', 0)} | {cpu:.2f} |")
            verdict = lv["verdict"]
            cache = verdict["cached_share"]
            ceiling = _served_all(lv["configs"].get(verdict.get("best_static") or ""))
            behind = ("" if verdict["vs_adaptive"].get("met") is not False else
                      _behind_adaptive(lv["configs"].get("router"),
                                       lv["configs"].get("adaptive")))
            checks = [
                _agentic_check(f"router vs best static pool ({verdict.get('best_static')})",
                               verdict["vs_best_static"]) + ceiling,
                _agentic_check("router vs sglang-router cache_aware",
                               verdict["vs_cache_aware"]),
                _agentic_check("router vs adaptive", verdict["vs_adaptive"]) + behind,
                f"cached share {_pct(cache.get('router'))} vs never-moving (pinned static "
                f"pools, best) {_pct(cache.get('never_moves'))}: gap "
                f"{_f(cache.get('gap_points'))} points (target <= {cache['target_points']:g}):"
                f" {_check(cache.get('met'), 'gap too large')}"]
            slo = lv.get("verdict_slo")
            if slo is not None:
                checks.append(
                    "router-slo (not judged): "
                    + ", ".join(f"{_f(slo[k].get('ratio'), 2)}x the {label}"
                                for k, label in _AGENTIC_COMPARED)
                    + f"; cached share gap {_f(slo['cached_share'].get('gap_points'))} points")
            lines += ["", *[f"- {c}" for c in checks], ""]
            for key, label in _AGENTIC_COMPARED:
                if verdict[key].get("met") is False:
                    why = ("; out of reach, see below" if ceiling and key == "vs_best_static"
                           else "; why: see below" if behind and key == "vs_adaptive" else "")
                    misses.append(f"{section} {profile} {lv['rate']:g}/s: router goodput "
                                  f"{_f(verdict[key]['ratio'], 2)}x the {label} "
                                  f"(target {verdict[key]['target']:g}x{why})")
            if cache.get("met") is False:
                misses.append(f"{section} {profile} {lv['rate']:g}/s: cached share "
                              f"{_f(cache['gap_points'])} points below never-moving")
    return lines, misses


def render(results: dict[str, Any], images: dict[str, str], commands: list[str],
           status: str, started: str, elapsed_s: float, commit: str | None = None) -> str:
    lines = ["# specrouter benchmarks", "",
             "Generated by `make bench` (`python -m loadtest.bench --report "
             "docs/benchmarks.md`); do not edit by hand.", ""]
    if status:
        lines += [f"> **Status:** {status}", ""]
    lines += [f"- Measured: {started} UTC, {elapsed_s / 60:.1f} min in all",
              f"- Commit: `{commit or git_commit()}`",
              f"- Machine: {machine()}",
              *host_cpu_lines(results),
              "- Engines: the shared-GPU SGLang simulator (`specrouter sim`); the simulator, "
              "the router(s) and the load generator share this machine's cores.",
              "- Commands:", *[f"  - `{c}`" for c in commands], ""]
    body: list[str] = []
    misses: list[str] = []
    if "sweep" in results:
        part, miss = sweep_section(results["sweep"], images)
        body += part
        misses += miss
    for key in sorted(k for k in results if k.startswith("trace:")):
        part, miss = trace_section(results[key], images.get(key))
        body += part
        misses += miss
    if "openloop" in results:
        part, miss = openloop_section(results["openloop"], images)
        body += part
        misses += miss
    for section in AGENTIC_SECTIONS:
        if section in results:
            part, miss = agentic_section(results[section], images, section)
            body += part
            misses += miss
    if "overhead" in results or "peer" in results:
        part, miss = overhead_section(results.get("overhead"), results.get("peer"),
                                      results.get("overhead-eagle"),
                                      results.get("overhead-pools"))
        body += part
        misses += miss
    if "connect-burst" in results:
        body += connect_burst.lines(results["connect-burst"])
    lines += ["## Targets missed", ""]
    lines += [f"- {m}" for m in misses] if misses else ["None of the checked targets."]
    lines += ["", *body]
    return "\n".join(lines).rstrip() + "\n"
