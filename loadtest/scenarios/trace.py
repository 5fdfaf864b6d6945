"""`trace`: a phased trace through the router and through each static pool, on goodput.

Goodput = output tokens of the requests that met the latency SLO (TTFT and TPOT), per
second. Each config gets a fresh simulated group (so accept-length changes of one run
do not leak into the next). The router's choice per request comes from its
`x-specrouter-pool` response header; a switch event is a change of that choice between
consecutive requests, and the timeline bins the share of new requests sent to EAGLE-3.
The router's `/policy` view is also sampled while it runs, when it has one.

Router configs are the sweep's variants (`router`, `router-w0`, `router-goodput`): before
the first of them, `specrouter calibrate` measures the group with the first phase's
control applied (e.g. accept length 3.0), and its policy is what every variant starts
with; the router's timers run on the simulator's clock (`router_time_env`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest import loopback
from loadtest.generator import LoadGenerator, Phase
from loadtest.metrics import SLO, RequestResult, summarize, write_json, write_tagged_csv
from loadtest.procs import SimGroup, Stack, reset_engines, served_model, sim_control
from loadtest.promptset import RequestShape, load_prompts
from loadtest.scenarios.common import (
    CpuWatch,
    cached_calibration,
    calibrate,
    decision_counts,
    run_async,
    saturated,
)
from loadtest.scenarios.sweep import DEFAULT_LEVELS, VARIANTS, router_env
from loadtest.traces import load_trace, scaled

DEFAULT_TIME_SCALE = 0.1
CONFIGS = ("eagle", "baseline", "router")
ALL_CONFIGS = ("eagle", "baseline", *VARIANTS)
GOODPUT_TARGET = 1.15


@dataclass
class TraceSettings:
    profile: str = "seed-coding"
    trace: str = "burst"
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    time_scale: float = DEFAULT_TIME_SCALE
    length_factor: float = 1.0  # stretch or shrink every phase (quick runs)
    input_tokens: int = 1000
    output_tokens: int = 256
    seed: int = 7
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    bin_s: float = 10.0  # timeline bin, simulated seconds
    # a second, looser SLO reported next to the first (None: not reported)
    alt_slo_ttft_s: float | None = None
    alt_slo_tpot_s: float | None = None
    calibrate: bool = True
    calibrate_levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    calibrate_duration_s: float = 4.0
    note: str = ""  # why this trace, SLO and profile (for the report)
    progress: bool = True
    router_env: dict[str, str] = field(default_factory=dict)
    out_dir: str | None = None

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s)

    @property
    def alt_slo(self) -> SLO | None:
        if self.alt_slo_ttft_s is None or self.alt_slo_tpot_s is None:
            return None
        return SLO(self.alt_slo_ttft_s, self.alt_slo_tpot_s)


async def _sample_policy(url: str, t0: float, samples: list[dict[str, Any]],
                         interval: float) -> None:
    """GET /policy periodically; stops quietly if the router has no such route."""
    async with loopback.async_client(timeout=2.0) as client:
        while True:
            try:
                response = await client.get(f"{url}/policy")
                if response.status_code == 404:
                    return
                if response.status_code == 200:
                    samples.append({"t": time.perf_counter() - t0, "policy": response.json()})
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(interval)


async def _drive(url: str, model: str, s: TraceSettings, phases: list[Phase],
                 sim: SimGroup, router_url: str | None
                 ) -> tuple[list[RequestResult], list[dict[str, Any]]]:
    shape = RequestShape(model, s.input_tokens, s.output_tokens)

    async def control(phase: Phase) -> None:
        assert phase.control is not None
        await asyncio.to_thread(sim_control, sim.eagle_url, phase.control)

    samples: list[dict[str, Any]] = []
    await asyncio.to_thread(reset_engines, sim.urls().values(), s.seed)
    async with LoadGenerator(url, shape, load_prompts(), seed=s.seed, progress=s.progress,
                             time_scale=s.time_scale) as gen:
        sampler = None
        if router_url is not None:
            sampler = asyncio.create_task(_sample_policy(
                router_url, time.perf_counter() - gen.now(), samples,
                max(0.1, s.bin_s * s.time_scale / 4)))
        try:
            results = await gen.trace(phases, control)
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
    return results, samples


def switch_events(results: list[RequestResult], time_scale: float) -> list[dict[str, Any]]:
    """Times (simulated s) where the pool of a new request differs from the previous one."""
    events: list[dict[str, Any]] = []
    previous = ""
    for r in sorted((r for r in results if r.pool), key=lambda r: r.start):
        if previous and r.pool != previous:
            events.append({"t": r.start / time_scale, "from": previous, "to": r.pool})
        previous = r.pool
    return events


def _spread(r: RequestResult, lo: float, hi: float) -> float:
    """The share of a request's output tokens generated within [lo, hi): its tokens are
    spread evenly from its first token to its end. Counting them all at completion
    would make closed-loop bursts (many requests ending together) look like spikes."""
    if r.ttft is None or r.end is None:
        return 0.0
    first = r.start + r.ttft
    if r.end <= first:
        return float(r.output_tokens) if lo <= r.end < hi else 0.0
    overlap = max(0.0, min(hi, r.end) - max(lo, first))
    return r.output_tokens * overlap / (r.end - first)


def timeline(results: list[RequestResult], s: TraceSettings) -> list[dict[str, Any]]:
    """Per bin (simulated s): requests started, share sent to EAGLE, throughput and
    goodput (tokens generated in the bin, by all requests / by those meeting the SLO)."""
    if not results:
        return []
    width = s.bin_s * s.time_scale
    end = max((r.end or r.start) for r in results)
    done = [r for r in results if r.ok]
    good = [r for r in done if s.slo.met(r, s.time_scale)]
    bins: list[dict[str, Any]] = []
    for i in range(int(end // width) + 1):
        lo, hi = i * width, (i + 1) * width
        started = [r for r in results if lo <= r.start < hi]
        routed = [r for r in started if r.pool]
        bins.append({
            "t": lo / s.time_scale,
            "started": len(started),
            "eagle_share": (sum(r.pool == "eagle" for r in routed) / len(routed)
                            if routed else None),
            "output_tok_s": sum(_spread(r, lo, hi) for r in done) / s.bin_s,
            "goodput_tok_s": sum(_spread(r, lo, hi) for r in good) / s.bin_s,
        })
    return bins


def _router_policy(s: TraceSettings, sim: SimGroup, phases: list[Phase],
                   cache: dict[str, Any], log: Any) -> dict[str, Any]:
    """The calibrated policy (measured once per trace, on the first router config's
    group, with the first phase's control in force)."""
    if not s.calibrate:
        return {}
    if "calibration" not in cache:
        control = phases[0].control if phases else None
        key = (s.profile, json.dumps(control, sort_keys=True) if control else "")
        if control and cached_calibration(key) is None:
            sim_control(sim.eagle_url, control)
        try:
            cache["calibration"] = calibrate(
                sim.eagle_url, sim.baseline_url, s.calibrate_levels, s.calibrate_duration_s,
                s.input_tokens, s.output_tokens, s.out_dir, f"{s.trace}-{s.profile}", log,
                cache_key=key, time_scale=s.time_scale)
        except RuntimeError as exc:
            cache["calibration"] = {"error": str(exc)[-2000:], "policy": {}}
    return dict(cache["calibration"].get("policy") or {})


def run_config(config: str, s: TraceSettings, phases: list[Phase],
               cache: dict[str, Any] | None = None, log: Any = print) -> dict[str, Any]:
    cache = {} if cache is None else cache
    env: dict[str, str] = {}
    decisions: dict[str, float] = {}
    with Stack() as stack:
        sim = stack.sim_group("gpu0", s.profile, s.time_scale, s.seed)
        model = served_model(sim.eagle_url)
        pids = {"sim": sim.child.pid}
        router_url = None
        if config.startswith("router"):
            policy = _router_policy(s, sim, phases, cache, log)
            env = router_env(policy, config, s.time_scale, s.profile)
            router = stack.router(sim.backends(), env={**env, **s.router_env})
            router_url, pids["router"] = router.url, router.child.pid
        url = {"eagle": sim.eagle_url, "baseline": sim.baseline_url}.get(config, router_url)
        assert url is not None
        watch = CpuWatch(pids)
        results, samples = run_async(_drive(url, model, s, phases, sim, router_url))
        shares = watch.shares()
        if router_url is not None:
            decisions = decision_counts(router_url)
    out: dict[str, Any] = {
        "summary": _summary(results, s),
        "phases": {p.name: _summary([r for r in results if r.phase == p.name], s)
                   for p in phases},
        "timeline": timeline(results, s),
        "cpu_cores": shares, "saturated": saturated(shares),
    }
    if router_url is not None:
        out["switch_events"] = switch_events(results, s.time_scale)
        out["decisions"] = decisions
        out["policy"] = json.loads(env["SPECROUTER_POLICY"])
        out["env"] = {k: v for k, v in env.items() if k != "SPECROUTER_POLICY"}
        out["policy_samples"] = len(samples)
        if samples:
            out["policy_last"] = samples[-1]["policy"]
    if s.out_dir:
        Path(s.out_dir).mkdir(parents=True, exist_ok=True)
        write_tagged_csv(Path(s.out_dir) / f"trace-{s.trace}-{config}.csv",
                         [({"config": config}, r) for r in results])
    return out


def _summary(results: list[RequestResult], s: TraceSettings) -> dict[str, Any]:
    out = summarize(results, time_scale=s.time_scale, slo=s.slo)
    alt = s.alt_slo
    if alt is not None and results:
        loose = summarize(results, time_scale=s.time_scale, slo=alt)
        out["alt"] = {k: loose[k] for k in ("goodput_tok_s", "slo_met", "slo")}
    return out


def run_trace(s: TraceSettings, log: Any = print) -> dict[str, Any]:
    phases = scaled(load_trace(s.trace), s.length_factor)
    result: dict[str, Any] = {"scenario": "trace", "settings": asdict(s),
                              "phases": [asdict(p) for p in phases], "configs": {}}
    cache: dict[str, Any] = {}
    for config in s.configs:
        try:
            result["configs"][config] = run_config(config, s, phases, cache, log)
        except RuntimeError as exc:
            result["configs"][config] = {"error": str(exc)[-2000:]}
            log(f"  trace {s.trace} {config}: FAILED {str(exc)[:200]}")
            continue
        summary = result["configs"][config]["summary"]
        log(f"  trace {s.trace} {config:14s} goodput {summary['goodput_tok_s']:8.1f} tok/s  "
            f"throughput {summary['output_tok_s']:8.1f} tok/s  SLO met "
            f"{summary['slo_met']}/{summary['requests']}  "
            f"{result['configs'][config].get('decisions', '')}")
    if "calibration" in cache:
        result["calibration"] = cache["calibration"]
    result["comparison"] = compare(result)
    if s.out_dir:
        write_json(Path(s.out_dir) / f"trace-{s.trace}.json", result)
    return result


def compare(result: dict[str, Any]) -> dict[str, Any]:
    """Each router config against the better static pool on goodput (and, when both ran,
    the goodput strategy against the threshold router)."""
    goodput = {c: v["summary"]["goodput_tok_s"] for c, v in result["configs"].items()
               if "summary" in v}
    static = {c: g for c, g in goodput.items() if not c.startswith("router")}
    out: dict[str, Any] = {"goodput_tok_s": goodput, "target": GOODPUT_TARGET, "routers": {}}
    if static:
        best = max(static, key=lambda c: static[c])
        out["best_static"] = best
        for c, g in goodput.items():
            if c.startswith("router"):
                out["routers"][c] = g / static[best] if static[best] > 0 else None
        if "router" in out["routers"]:
            out["router_vs_best_static"] = out["routers"]["router"]
    if "router" in goodput and "router-goodput" in goodput and goodput["router"] > 0:
        out["goodput_vs_threshold"] = goodput["router-goodput"] / goodput["router"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="seed-coding")
    parser.add_argument("--trace", default="burst",
                        help="built-in (burst, accept-shift) or a JSON file")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--length-factor", type=float, default=1.0,
                        help="multiply every phase duration")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (simulated)")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds (simulated)")
    parser.add_argument("--bin", type=float, default=10.0, help="timeline bin, seconds")


def settings_from_args(args: argparse.Namespace) -> TraceSettings:
    return TraceSettings(
        profile=args.profile, trace=args.trace,
        configs=[c for c in args.configs.split(",") if c], time_scale=args.time_scale,
        length_factor=args.length_factor * (0.25 if args.quick else 1.0),
        input_tokens=args.input_tokens, output_tokens=args.output_tokens, seed=args.seed,
        slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, bin_s=args.bin,
        progress=not args.no_progress, out_dir=args.out)


def main(args: argparse.Namespace) -> dict[str, Any]:
    return run_trace(settings_from_args(args))
