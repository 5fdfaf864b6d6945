"""`openloop`: Poisson arrivals from light load to saturation and on/off bursts, with
heavy-tailed mixed request lengths, through each static pool and the router configs.

Per profile one simulated GPU group is started; every config replays the same
workloads (`loadtest.workload`: arrival times and lengths drawn from fixed seeds before
the run) one rate after the other, lightest first, then the burst pattern; every rate
starts from an idle group with empty prefix caches and the same simulator seed
(`procs.reset_engines`).

Rates are fractions of the profile's saturation rate: the request rate the better pool
alone serves at `SATURATION_BATCH` requests in its batch, from the profile's cost model
(decode throughput at that batch) plus its prefill cost per request, for the workload's
mean lengths (`capacity`). The burst pattern is on/off modulated Poisson: `BURST_ON` x
saturation during on periods, `BURST_OFF` x saturation in between.

Configs: `eagle` and `baseline` (each engine of the group alone, the other idles);
`router`: `specrouter serve` with nothing set (what a new user gets; only the router's
timers are moved to the simulator's clock, as in every scenario: `router_time_env`,
`scaled_policy`); `router-calibrated`: what `specrouter calibrate` writes with its default
strategy on the same group: the online strategy seeded with the fitted cost model;
`router-goodput`: the goodput strategy with the profile's cost model on top of the
calibrated threshold band (the sweep's variant). The router runs all rates of a config in
one process, so what it learns at one rate it keeps at the next, as a deployment would.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.generator import LoadGenerator
from loadtest.metrics import RequestResult, summarize, write_json, write_tagged_csv
from loadtest.procs import Stack, reset_engines, served_model
from loadtest.promptset import RequestShape, load_prompts
from loadtest.residence import attach_engine_time, fetch_stays
from loadtest.scenarios.common import (
    CpuWatch,
    calibrate,
    decision_counts,
    group_reports,
    router_time_env,
    run_async,
    saturated,
    scaled_policy,
)
from loadtest.scenarios.sweep import DEFAULT_LEVELS, router_env
from loadtest.workload import Arrival, LengthDist, OnOff, onoff_workload, poisson_workload
from specrouter.backends import Pool
from specrouter.routing.strategies.registry import DEFAULT_STRATEGY

STATIC: tuple[Pool, Pool] = ("eagle", "baseline")
ROUTERS = ("router", "router-calibrated", "router-goodput")
# What `specrouter calibrate` writes as the policy of its default (online) strategy.
CALIBRATED_POLICY = {"mode": "auto", "strategy": DEFAULT_STRATEGY}
CONFIGS = (*STATIC, *ROUTERS)
# The configs the done-when judges: the default must meet the targets, the calibrated
# one as well.
JUDGED = ("router", "router-calibrated")
DEFAULT_PROFILES = ("seed-coding", "h200-llama3-8b")

# The targets against the better static pool at the same rate.
LATENCY_TARGET = 1.05  # median end-to-end latency, at most
THROUGHPUT_TARGET = 0.97  # output tokens/s, at least
TTFT_P99_TARGET = 1.10  # TTFT p99, at most

# The better pool alone holds this many requests at the saturation rate. The top rate,
# 1.1x, is beyond EAGLE-3's capacity on both profiles (its batch is capped at 48) and
# within the baseline's at its larger batches: the regime where a router must move.
SATURATION_BATCH = 64
DEFAULT_FRACTIONS = (0.06, 0.2, 0.45, 0.8, 1.1)
# h200-llama3-8b's cost model prices steps at its nearest measured context (2048 tokens,
# above this workload's mean of about 1220), so it underestimates EAGLE-3's capacity:
# measured, EAGLE-3 alone still led at 1.1x (17.2 req/s: p50 1.23 s, the baseline 1.55 s)
# and queued at 1.4x (21.9 req/s: TTFT p99 1.78 s; p50 2.68 s, the baseline 1.91 s).
PROFILE_FRACTIONS = {"h200-llama3-8b": (*DEFAULT_FRACTIONS, 1.4)}
# Requests per Poisson rate: at least MIN_REQUESTS, and arrivals over at least the time
# SATURATION_REQUESTS take at the saturation rate (three batches of 64), so that a loaded
# rate reaches its steady batch and queue instead of measuring the ramp: at 1.1 x
# saturation that is 212 requests. With 100 the TTFT p99 (linear interpolation) is the
# second-largest value, so no single request decides it, as it does with 32 to 64
# (docs/policy.md section 5b).
MIN_REQUESTS = 100
SATURATION_REQUESTS = 192
# Burst pattern: on at 1.2x the saturation rate (a burst no pool absorbs without a
# queue), off at a light load, in periods holding about this many arrivals each.
BURST_ON, BURST_OFF = 1.2, 0.06
BURST_ON_ARRIVALS, BURST_OFF_ARRIVALS, BURST_CYCLES = 16, 4, 2

# Simulator time scale per profile: the top rate sends 16 (seed-coding) and 44 (h200)
# requests per real second, which 2 cores carry with the router. Each real millisecond
# the router spends shows as 1/scale simulated ms, so a larger scale is closer to
# hardware: at 0.1 a 2 ms proxy cost was 20 ms of a ~120 ms TTFT p99 on seed-coding.
TIME_SCALES = {"seed-coding": 0.2, "h200-llama3-8b": 0.5}
DEFAULT_TIME_SCALE = 0.1


@dataclass
class OpenLoopSettings:
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    fractions: list[float] = field(default_factory=lambda: list(DEFAULT_FRACTIONS))
    # per-profile fractions, in place of `fractions`
    profile_fractions: dict[str, list[float]] = field(
        default_factory=lambda: {p: list(f) for p, f in PROFILE_FRACTIONS.items()})
    min_requests: int = MIN_REQUESTS
    saturation_requests: int = SATURATION_REQUESTS
    time_scale: float = DEFAULT_TIME_SCALE
    profile_time_scales: dict[str, float] = field(default_factory=lambda: dict(TIME_SCALES))
    # prompt and output lengths (tokens): lognormal, clipped
    input_median: float = 800.0
    input_sigma: float = 0.8
    input_low: int = 64
    input_high: int = 6000
    output_median: float = 200.0
    output_sigma: float = 0.8
    output_low: int = 16
    output_high: int = 1024
    burst: bool = True
    burst_cycles: int = BURST_CYCLES
    burst_on_arrivals: int = BURST_ON_ARRIVALS
    burst_off_arrivals: int = BURST_OFF_ARRIVALS
    saturation_batch: int = SATURATION_BATCH
    calibrate: bool = True
    calibrate_levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    calibrate_duration_s: float = 5.0
    # the shape `specrouter calibrate` measures with (its defaults, as a user runs it)
    calibrate_input_tokens: int = 1000
    calibrate_output_tokens: int = 256
    seed: int = 7
    progress: bool = True
    router_env: dict[str, str] = field(default_factory=dict)
    out_dir: str | None = None

    @property
    def inputs(self) -> LengthDist:
        return LengthDist(self.input_median, self.input_sigma, self.input_low, self.input_high)

    @property
    def outputs(self) -> LengthDist:
        return LengthDist(self.output_median, self.output_sigma, self.output_low,
                          self.output_high)

    def scale_of(self, profile: str) -> float:
        return self.profile_time_scales.get(profile, self.time_scale)

    def fractions_of(self, profile: str) -> list[float]:
        return self.profile_fractions.get(profile, self.fractions)


# --- rates from the profile's pools ---------------------------------------------------------


def capacity_req_s(decode_tok_s: float, mean_output: float, prefill_ms: float) -> float:
    """Requests per second one pool completes when its decode runs at `decode_tok_s`:
    each request takes mean_output / decode_tok_s seconds of decode plus its prefill
    (the GPU does one or the other at a time)."""
    if decode_tok_s <= 0 or mean_output <= 0:
        raise ValueError("capacity needs positive throughput and output length")
    return 1.0 / (mean_output / decode_tok_s + prefill_ms / 1000.0)


def capacity(profile: str, inputs: LengthDist, outputs: LengthDist,
             batch: int = SATURATION_BATCH) -> dict[str, Any]:
    """Each pool's request rate at `batch` requests (its batch cap if lower), from the
    profile's cost model at the workload's mean context and the profile's prefill cost,
    and the saturation rate (the better pool's)."""
    from specrouter.routing.costsource import CostModelSource, profile_file

    raw = json.loads(profile_file(profile).read_text(encoding="utf-8"))
    prefill = raw.get("prefill", {})
    mean_in, mean_out = inputs.mean(), outputs.mean()
    ctx = round(mean_in + mean_out / 2)
    model = CostModelSource(profile=profile, ctx=ctx).model()
    accept = model.nominal_accept_length
    pools: dict[str, Any] = {}
    for pool in STATIC:
        pred = model.predict(pool, batch, accept)
        prefill_ms = (float(prefill.get("base_ms", 5.0))
                      + float(prefill.get("per_token_ms", 0.02)) * mean_in)
        if pool == "eagle":
            prefill_ms *= 1.0 + float(prefill.get("draft_factor", 0.1))
        pools[pool] = {"batch": pred.batch, "decode_tok_s": round(pred.throughput_tok_s, 1),
                       "prefill_ms": round(prefill_ms, 2),
                       "req_s": capacity_req_s(pred.throughput_tok_s, mean_out, prefill_ms)}
    better = max(pools, key=lambda p: pools[p]["req_s"])
    return {"pools": pools, "better": better, "saturation_req_s": pools[better]["req_s"],
            "batch": batch, "ctx": ctx, "accept_length": accept,
            "mean_input_tokens": round(mean_in, 1), "mean_output_tokens": round(mean_out, 1),
            "crossover": model.crossover(accept)}


def rates_for(saturation_req_s: float, fractions: list[float]) -> list[float]:
    """The fractions of the saturation rate, to 3 significant digits."""
    return [float(f"{f * saturation_req_s:.3g}") for f in fractions]


def requests_at(rate: float, saturation_req_s: float, min_requests: int,
                saturation_requests: int) -> int:
    """Requests for one rate: `min_requests`, or more so that arrivals last at least
    as long as `saturation_requests` take at the saturation rate."""
    span_s = saturation_requests / saturation_req_s
    return max(min_requests, math.ceil(rate * span_s - 1e-9))


def burst_pattern(saturation_req_s: float, cycles: int, on_arrivals: int = BURST_ON_ARRIVALS,
                  off_arrivals: int = BURST_OFF_ARRIVALS) -> OnOff:
    """On at BURST_ON x saturation for periods of about `on_arrivals` arrivals, off at
    BURST_OFF x saturation for about `off_arrivals`."""
    on_rate, off_rate = BURST_ON * saturation_req_s, BURST_OFF * saturation_req_s
    return OnOff(on_rate=on_rate, off_rate=off_rate, on_s=on_arrivals / on_rate,
                 off_s=off_arrivals / off_rate, cycles=cycles)


# --- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One measured load of a profile: a Poisson rate or the burst pattern."""

    name: str  # "rate 0.14" or "burst"
    arrivals: list[Arrival]
    rate: float | None  # Poisson rate (simulated req/s), None for the burst
    seed: int


def loads_of(profile: str, s: OpenLoopSettings) -> tuple[dict[str, Any], list[Load]]:
    cap = capacity(profile, s.inputs, s.outputs, s.saturation_batch)
    sat = cap["saturation_req_s"]
    loads = [Load(f"rate {rate:g}",
                  poisson_workload(rate, requests_at(rate, sat, s.min_requests,
                                                     s.saturation_requests),
                                   s.inputs, s.outputs, s.seed * 1000 + i),
                  rate, s.seed * 1000 + i)
             for i, rate in enumerate(rates_for(sat, s.fractions_of(profile)))]
    if s.burst:
        pattern = burst_pattern(cap["saturation_req_s"], s.burst_cycles, s.burst_on_arrivals,
                                s.burst_off_arrivals)
        seed = s.seed * 1000 + 999
        loads.append(Load("burst", onoff_workload(pattern, s.inputs, s.outputs, seed),
                          None, seed))
        cap["burst"] = asdict(pattern)
    return cap, loads


def in_simulated_ms(model: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """A fitted cost model in the simulator's milliseconds. `specrouter calibrate` times
    steps on the wall clock, which the simulator runs at `time_scale`, while the engines'
    telemetry (gen_throughput) counts simulated seconds; on hardware both are wall time."""
    def curve(c: dict[str, Any]) -> dict[str, Any]:
        if "points" in c:
            return {"points": [[b, ms / time_scale] for b, ms in c["points"]]}
        return {"poly": [k / time_scale for k in c["poly"]]}
    return {**model, "eagle": curve(model["eagle"]), "baseline": curve(model["baseline"])}


def config_env(config: str, calibration: dict[str, Any], scale: float, profile: str,
               folder: Path) -> dict[str, str]:
    """Environment of one router config (see the module docstring). The calibrated
    config is what `specrouter calibrate` writes with its default strategy: the router's
    own (online) strategy, seeded with the cost model fitted from the sweep
    (`--write-cost-model`, served from a file as a user would: `cost_model: {file: ...}`)."""
    if config == "router":
        return {**router_time_env(scale), "SPECROUTER_POLICY": json.dumps(scaled_policy({}, scale))}
    policy = dict(calibration.get("policy") or {})
    if config != "router-calibrated":
        return router_env(policy, config, scale, profile)
    env = {**router_time_env(scale),
           "SPECROUTER_POLICY": json.dumps(scaled_policy(CALIBRATED_POLICY, scale))}
    model = calibration.get("cost_model")
    if model:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"calibrate-{profile}-cost-model.json"
        simulated = in_simulated_ms(model, calibration.get("time_scale") or 1.0)
        path.write_text(json.dumps(simulated), encoding="utf-8")
        env["SPECROUTER_COST_MODEL"] = json.dumps({"file": str(path)})
    return env


async def _replay(url: str, engines: Sequence[str], pids: dict[str, int], model: str,
                  load: Load, scale: float, s: OpenLoopSettings
                  ) -> tuple[dict[str, Any], list[RequestResult]]:
    shape = RequestShape(model, round(s.input_median), round(s.output_median))
    async with LoadGenerator(url, shape, load_prompts(), seed=load.seed, progress=s.progress,
                             time_scale=scale) as gen:
        watch = CpuWatch(pids)
        results = await gen.replay(load.arrivals, phase=load.name)
        shares = watch.shares()
    attach_engine_time(results, fetch_stays(engines))
    summary = summarize(results, time_scale=scale)
    return {"load": load.name, "rate": load.rate, **summary, "cpu_cores": shares,
            "saturated": saturated(shares)}, results


def run_profile(profile: str, s: OpenLoopSettings, log: Any = print) -> dict[str, Any]:
    scale = s.scale_of(profile)
    cap, loads = loads_of(profile, s)
    out: dict[str, Any] = {"time_scale": scale, "capacity": cap,
                           "loads": [{"name": ld.name, "rate": ld.rate,
                                      "requests": len(ld.arrivals)} for ld in loads],
                           "configs": {}}
    log(f"  {profile}: saturation {cap['saturation_req_s']:.3g} req/s ({cap['better']}), "
        f"loads {[ld.name for ld in loads]}")
    folder = Path(s.out_dir) if s.out_dir else Path(tempfile.mkdtemp(prefix="openloop-"))
    with Stack() as stack:
        sim = stack.sim_group("gpu0", profile, scale, s.seed)
        model = served_model(sim.eagle_url)
        for config in s.configs:
            pids = {"sim": sim.child.pid}
            url, router, env = sim.urls().get(config), None, {}
            if url is None:
                if config != "router" and s.calibrate and "calibration" not in out:
                    out["calibration"] = _calibration(sim.eagle_url, sim.baseline_url, profile,
                                                      scale, s, log)
                env = config_env(config, out.get("calibration") or {}, scale, profile, folder)
                try:
                    router = stack.router(sim.backends(), env={**env, **s.router_env})
                except RuntimeError as exc:
                    out["configs"][config] = {"error": str(exc)[-2000:], "loads": []}
                    continue
                url, pids["router"] = router.url, router.child.pid
            rows: list[dict[str, Any]] = []
            tagged: list[tuple[dict[str, Any], RequestResult]] = []
            for load in loads:
                reset_engines(sim.urls().values(), load.seed)
                row, results = run_async(_replay(url, list(sim.urls().values()), pids, model,
                                                 load, scale, s))
                if router is not None:  # what the router believes at the end of the load
                    row["groups"] = group_reports(router.url)
                rows.append(row)
                tagged.extend(({"load": load.name}, r) for r in results)
                log(f"  {profile} {config:17s} {load.name:11s} {row['output_tok_s']:8.1f} tok/s"
                    f"  e2e p50 {row['e2e']['p50']:7.2f} s  TTFT p99 {row['ttft']['p99']:6.3f} s"
                    f"  errors {row['errors']}  pools {row.get('by_pool', {})}"
                    f"  cpu {row['cpu_cores']}")
            data: dict[str, Any] = {"loads": rows}
            if router is not None:
                data["decisions"] = decision_counts(router.url)
                data["policy"] = json.loads(env["SPECROUTER_POLICY"])
                data["env"] = {k: v for k, v in env.items() if k != "SPECROUTER_POLICY"}
                stack.stop(router.child)
            out["configs"][config] = data
            if s.out_dir:
                path = Path(s.out_dir) / f"openloop-{profile}-{config}.csv"
                path.parent.mkdir(parents=True, exist_ok=True)
                write_tagged_csv(path, tagged)
    return out


def _calibration(eagle_url: str, baseline_url: str, profile: str, scale: float,
                 s: OpenLoopSettings, log: Any) -> dict[str, Any]:
    """`specrouter calibrate` on the group, as a user runs it (its default request
    shape); the sweep's calibration of the same profile is reused when it ran."""
    try:
        return calibrate(eagle_url, baseline_url, s.calibrate_levels, s.calibrate_duration_s,
                         s.calibrate_input_tokens, s.calibrate_output_tokens, s.out_dir,
                         profile, log, cache_key=(profile, ""), time_scale=scale)
    except RuntimeError as exc:
        return {"error": str(exc)[-2000:], "policy": {}}


def run_openloop(s: OpenLoopSettings, log: Any = print) -> dict[str, Any]:
    result: dict[str, Any] = {"scenario": "openloop", "settings": asdict(s), "profiles": {}}
    for profile in s.profiles:
        log(f"openloop {profile}")
        result["profiles"][profile] = run_profile(profile, s, log)
    result["comparison"] = compare(result)
    if s.out_dir:
        write_json(Path(s.out_dir) / "openloop.json", result)
    return result


# --- verdicts --------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def better_static(statics: dict[str, dict[str, Any]]) -> str | None:
    """The better static pool at a load: the one with the lower median e2e latency (the
    higher throughput between equal medians); None without a finite median."""
    timed = {name: p50 for name, lv in statics.items()
             if (p50 := _finite(lv["e2e"]["p50"])) is not None}
    if not timed:
        return None
    return min(timed, key=lambda name: (timed[name],
                                        -(_finite(statics[name]["output_tok_s"]) or 0.0)))


def judged_ttft(level: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    """The TTFT statistics the target judges (`key`, default `ttft_key([level])`)."""
    stats: dict[str, Any] = level[key or ttft_key([level])]
    return stats


def ttft_key(levels: Iterable[dict[str, Any]]) -> str:
    """`ttft_deployed` where every one of `levels` has it: only the engines' part of each
    request converted to simulated time (`loadtest.residence`); else `ttft`, the whole
    time converted. Configs compared with each other are judged on the same one."""
    return "ttft_deployed" if all("ttft_deployed" in lv for lv in levels) else "ttft"


def ratios(row: dict[str, Any], statics: dict[str, dict[str, Any]],
           better: str | None) -> dict[str, Any]:
    """One config's figures against the better static pool (`better`, of
    `better_static`): its median latency and TTFT p99 (`judged_ttft`), and the higher
    throughput of the two pools. The TTFT p99 against the lower of the two pools' is shown
    too, not judged: where EAGLE-3 is the better pool its own TTFT p99 is above the
    baseline's, so that ratio prices the pool, not the router."""
    key = ttft_key([row, *statics.values()])
    tputs = [v for lv in statics.values() if (v := _finite(lv["output_tok_s"])) is not None]
    ttfts = [v for lv in statics.values()
             if (v := _finite(judged_ttft(lv, key)["p99"])) is not None]
    ref_p50 = _finite(statics[better]["e2e"]["p50"]) if better is not None else None
    ref_ttft = (_finite(judged_ttft(statics[better], key)["p99"]) if better is not None
                else None)
    tput, p50, ttft = (_finite(row["output_tok_s"]), _finite(row["e2e"]["p50"]),
                       _finite(judged_ttft(row, key)["p99"]))
    out: dict[str, Any] = {
        "throughput_ratio": tput / max(tputs) if tput is not None and tputs and max(tputs) > 0
        else None,
        "latency_ratio": p50 / ref_p50 if p50 is not None and ref_p50 else None,
        "ttft_p99_ratio": ttft / ref_ttft if ttft is not None and ref_ttft else None,
        "ttft_p99_ratio_lowest": (ttft / min(ttfts) if ttft is not None and ttfts
                                  and min(ttfts) > 0 else None),
        # simulated seconds over the better pool's TTFT p99
        "ttft_p99_excess_s": ttft - ref_ttft if ttft is not None and ref_ttft is not None
        else None,
        # whether the proxies' real time counts as such (`judged_ttft`) or 1 / time scale
        # times over (then the excess times the time scale is the real time it stands for)
        "ttft_deployed": key == "ttft_deployed",
        "errors": row["errors"],
    }
    out["meets_throughput"] = (out["throughput_ratio"] is not None
                               and out["throughput_ratio"] >= THROUGHPUT_TARGET)
    out["meets_latency"] = (out["latency_ratio"] is not None
                            and out["latency_ratio"] <= LATENCY_TARGET)
    out["meets_ttft"] = (out["ttft_p99_ratio"] is not None
                         and out["ttft_p99_ratio"] <= TTFT_P99_TARGET)
    out["meets"] = (out["meets_throughput"] and out["meets_latency"] and out["meets_ttft"]
                    and row["errors"] == 0)
    return out


def compare_profile(data: dict[str, Any]) -> dict[str, Any]:
    """Per load: the better static pool's figures and each router config's ratios; per
    judged config: whether it met every Poisson rate (the burst is reported, not judged)."""
    configs = data.get("configs", {})
    by_load = {name: {lv["load"]: lv for lv in cfg.get("loads", [])}
               for name, cfg in configs.items()}
    rows: list[dict[str, Any]] = []
    for load in data.get("loads", []):
        name = load["name"]
        statics: dict[str, dict[str, Any]] = {
            c: by_load[c][name] for c in STATIC if name in by_load.get(c, {})}
        row: dict[str, Any] = {"load": name, "rate": load["rate"], "routers": {}}
        better = better_static(statics)
        if better is not None:
            key = ttft_key(statics.values())
            row["best"] = {
                "pool": better,
                "output_tok_s": max(lv["output_tok_s"] for lv in statics.values()),
                "e2e_p50": statics[better]["e2e"]["p50"],
                "ttft_p99": judged_ttft(statics[better], key)["p99"],
                "ttft_p99_lowest": min(judged_ttft(lv, key)["p99"] for lv in statics.values())}
            for config, levels in by_load.items():
                if config not in STATIC and name in levels:
                    row["routers"][config] = ratios(levels[name], statics, better)
        rows.append(row)
    verdict: dict[str, Any] = {}
    for config in configs:
        if config in STATIC:
            continue
        judged = [r["routers"].get(config) for r in rows if r["rate"] is not None]
        verdict[config] = {"rates": len(judged),
                           "met": sum(1 for j in judged if j is not None and j["meets"]),
                           "meets_all": bool(judged) and all(j is not None and j["meets"]
                                                             for j in judged)}
    return {"rows": rows, "verdict": verdict}


def compare(result: dict[str, Any]) -> dict[str, Any]:
    return {profile: compare_profile(data) for profile, data in result["profiles"].items()}


# --- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"any of {','.join(CONFIGS)}")
    parser.add_argument("--fractions",
                        help="Poisson rates as fractions of the saturation rate, for every "
                             f"profile (default: {','.join(map(str, DEFAULT_FRACTIONS))}, "
                             "and 1.4 too on h200-llama3-8b)")
    parser.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                        help="requests per rate, at least")
    parser.add_argument("--saturation-requests", type=int, default=SATURATION_REQUESTS,
                        help="arrivals span at least the time these take at saturation")
    parser.add_argument("--no-burst", action="store_true")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--router-env", type=json.loads, default={}, metavar="JSON",
                        help="extra environment of every router config, on top of the "
                             """config's own, e.g. '{"SPECROUTER_POLICY": "..."}'""")


def settings_from_args(args: argparse.Namespace) -> OpenLoopSettings:
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}: use {','.join(CONFIGS)}")
    s = OpenLoopSettings(
        profiles=[p for p in args.profiles.split(",") if p], configs=configs,
        min_requests=args.min_requests, saturation_requests=args.saturation_requests,
        burst=not args.no_burst,
        calibrate=not args.no_calibrate, seed=args.seed, progress=not args.no_progress,
        router_env=dict(args.router_env), out_dir=args.out)
    if args.fractions:
        s.fractions = [float(x) for x in args.fractions.split(",") if x]
        s.profile_fractions = {}
    if args.quick:
        quick(s)
    return s


def quick(s: OpenLoopSettings) -> OpenLoopSettings:
    """The smoke version (about a minute): one profile, three rates of a few short
    requests, one burst cycle, a short calibration. Its figures check the pipeline, not
    the router: short requests at a coarse time scale are mostly overhead."""
    s.profiles, s.profile_time_scales = ["seed-coding"], {"seed-coding": 0.25}
    s.fractions, s.min_requests, s.saturation_requests = [0.1, 0.5, 1.1], 6, 6
    s.profile_fractions = {}
    s.burst_cycles, s.burst_on_arrivals, s.burst_off_arrivals = 1, 8, 2
    s.input_median, s.input_high, s.output_median, s.output_sigma, s.output_high = (
        300.0, 1500, 64.0, 0.5, 128)
    s.calibrate_levels, s.calibrate_duration_s = [1, 16], 1.0
    s.calibrate_input_tokens, s.calibrate_output_tokens = 500, 64
    return s


def main(args: argparse.Namespace) -> dict[str, Any]:
    return run_openloop(settings_from_args(args))
