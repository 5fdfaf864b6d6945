"""`sweep`: closed-loop concurrency levels for eagle-only, baseline-only and the router.

Per profile one simulated GPU group is started (both engines share its simulated GPU)
and, for the router config, `specrouter serve` in front of it. eagle-only and
baseline-only go straight to that engine, so the other engine of the group sits idle,
as a static deployment of one pool per GPU would. Before the router configs,
`specrouter calibrate` sweeps the same group (as a user would) and its policy is
applied to every router variant:

- `router`: the calibrated threshold policy, default settings (arrival window on);
- `router-w0`: the same with the arrival window off (`admission.arrival_window_ms=0`);
- `router-goodput`: `strategy: goodput` with the profile's cost model
  (`cost_model: {profile: ...}`), with shadow probes at the default 30 s;
- `router-goodput-noprobe`: the same without probes.

The router's timers are scaled to the simulator's clock (`router_time_env`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.generator import LoadGenerator
from loadtest.metrics import RequestResult, summarize, write_json, write_tagged_csv
from loadtest.procs import Stack, reset_engines, served_model
from loadtest.promptset import RequestShape, load_prompts
from loadtest.scenarios.common import (
    CpuWatch,
    calibrate,
    decision_counts,
    router_time_env,
    run_async,
    saturated,
    scaled_policy,
)
from specrouter.routing.policy import Policy

STATIC = ("eagle", "baseline")
# The goodput probe settings (the product's defaults), spelled out so that the router's
# timers can be scaled to the simulated clock; only where the router has them.
GOODPUT_PROBE: dict[str, float] = (
    {"goodput_probe_s": 30.0, "goodput_probe_memory_s": 600.0}
    if "goodput_probe_memory_s" in Policy.model_fields else {})
# Router variants: extra environment, policy fields on top of the calibrated ones, and
# whether the router gets the profile's cost model.
VARIANTS: dict[str, dict[str, Any]] = {
    "router": {"env": {}, "policy": {}, "model": False},
    "router-w0": {"env": {"SPECROUTER_ADMISSION__ARRIVAL_WINDOW_MS": "0"}, "policy": {},
                  "model": False},
    "router-goodput": {"env": {}, "policy": {"strategy": "goodput", **GOODPUT_PROBE},
                       "model": True},
    # the same without accept-length probes: isolates what the probes cost
    "router-goodput-noprobe": {"env": {}, "policy": {
        "strategy": "goodput", "goodput_probe_s": 0.0}, "model": True},
}
CONFIGS = (*STATIC, *VARIANTS)
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROFILES = ("seed-coding", "h200-llama3-8b")


@dataclass
class SweepSettings:
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    time_scale: float = 0.1
    # per-profile time scale (a fast profile at 0.1 is CPU bound on 2 cores)
    profile_time_scales: dict[str, float] = field(default_factory=dict)
    calibrate: bool = True
    calibrate_duration_s: float = 4.0  # real seconds per level
    rounds: int = 3  # requests per level = max(rounds * concurrency, min_requests)
    min_requests: int = 8
    input_tokens: int = 1000
    output_tokens: int = 256
    seed: int = 7
    progress: bool = True
    router_env: dict[str, str] = field(default_factory=dict)
    out_dir: str | None = None

    def requests_at(self, concurrency: int) -> int:
        return max(self.rounds * concurrency, self.min_requests)

    def scale_of(self, profile: str) -> float:
        return self.profile_time_scales.get(profile, self.time_scale)


async def _level(url: str, pids: dict[str, int], model: str, s: SweepSettings,
                 concurrency: int, scale: float) -> tuple[dict[str, Any], list[RequestResult]]:
    shape = RequestShape(model, s.input_tokens, s.output_tokens)
    async with LoadGenerator(url, shape, load_prompts(), seed=s.seed + concurrency,
                             progress=s.progress, time_scale=scale) as gen:
        watch = CpuWatch(pids)
        results = await gen.closed_loop(concurrency, num_requests=s.requests_at(concurrency),
                                        phase=f"c{concurrency}")
        shares = watch.shares()
    summary = summarize(results, time_scale=scale)
    return {"concurrency": concurrency, **summary, "cpu_cores": shares,
            "saturated": saturated(shares)}, results


COST_MODEL_CTX = 1200  # about the mean context of a 1000-in / 256-out request


def router_env(policy: dict[str, Any], variant: str, scale: float, profile: str
               ) -> dict[str, str]:
    """Environment of one router variant: timers, policy, variant settings, cost model."""
    spec = VARIANTS[variant]
    full = scaled_policy({**policy, **spec["policy"]}, scale)
    env = {**router_time_env(scale), "SPECROUTER_POLICY": json.dumps(full), **spec["env"]}
    if spec["model"]:
        env["SPECROUTER_COST_MODEL"] = json.dumps({"profile": profile, "ctx": COST_MODEL_CTX})
    return env


def run_profile(profile: str, s: SweepSettings, log: Any = print) -> dict[str, Any]:
    """All configs and levels of one profile; a config that cannot start is reported."""
    out: dict[str, Any] = {}
    scale = s.scale_of(profile)
    with Stack() as stack:
        sim = stack.sim_group("gpu0", profile, scale, s.seed)
        model = served_model(sim.eagle_url)
        policy: dict[str, Any] = {}
        for config in s.configs:
            pids = {"sim": sim.child.pid}
            url, router = {"eagle": sim.eagle_url, "baseline": sim.baseline_url}.get(config), None
            if url is None:
                if s.calibrate and "calibration" not in out:
                    try:
                        out["calibration"] = calibrate(
                            sim.eagle_url, sim.baseline_url, s.levels, s.calibrate_duration_s,
                            s.input_tokens, s.output_tokens, s.out_dir, profile, log,
                            cache_key=(profile, ""), time_scale=scale)
                        policy = dict(out["calibration"]["policy"])
                    except RuntimeError as exc:
                        out["calibration"] = {"error": str(exc)[-2000:]}
                env = router_env(policy, config, scale, profile)
                try:
                    router = stack.router(sim.backends(), env={**env, **s.router_env})
                except RuntimeError as exc:
                    out[config] = {"error": str(exc)[-2000:], "levels": []}
                    continue
                url, pids["router"] = router.url, router.child.pid
            levels: list[dict[str, Any]] = []
            all_results: list[tuple[int, RequestResult]] = []
            for c in s.levels:
                # Paired configs (a router sending every request to EAGLE-3 measured
                # 0.959x EAGLE-3 alone at h200 c=8 when the draws were not reseeded).
                reset_engines(sim.urls().values(), s.seed * 1000 + c)
                level, results = run_async(_level(url, pids, model, s, c, scale))
                levels.append(level)
                all_results.extend((c, r) for r in results)
                log(f"  {profile} {config:14s} c={c:<3d} {level['output_tok_s']:8.1f} tok/s  "
                    f"e2e p50 {level['e2e']['p50']:7.2f} s  errors {level['errors']}  "
                    f"pools {level.get('by_pool', {})}  cpu {level['cpu_cores']}")
            out[config] = {"levels": levels}
            if router is not None:
                out[config]["decisions"] = decision_counts(router.url)
                out[config]["policy"] = json.loads(env["SPECROUTER_POLICY"])
                out[config]["env"] = {k: v for k, v in env.items() if k != "SPECROUTER_POLICY"}
                stack.stop(router.child)
            if s.out_dir:
                _write_requests(Path(s.out_dir) / f"sweep-{profile}-{config}.csv", all_results)
    out["time_scale"] = scale
    return out


def _write_requests(path: Path, rows: list[tuple[int, RequestResult]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_tagged_csv(path, [({"concurrency": c}, r) for c, r in rows])


def run_sweep(s: SweepSettings, log: Any = print) -> dict[str, Any]:
    result: dict[str, Any] = {"scenario": "sweep", "settings": asdict(s), "profiles": {}}
    for profile in s.profiles:
        log(f"sweep {profile}")
        configs = run_profile(profile, s, log)
        result.setdefault("calibration", {})[profile] = configs.pop("calibration", None)
        result.setdefault("time_scales", {})[profile] = configs.pop("time_scale")
        result["profiles"][profile] = configs
    result["comparison"] = compare(result)
    if s.out_dir:
        write_json(Path(s.out_dir) / "sweep.json", result)
    return result


THROUGHPUT_TARGET = 0.97
LATENCY_TARGET = 1.05


def compare(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Router vs the better static pool at each level (throughput up, median latency down)."""
    table: dict[str, list[dict[str, Any]]] = {}
    for profile, configs in result["profiles"].items():
        rows: list[dict[str, Any]] = []
        static = {c: {lv["concurrency"]: lv for lv in configs.get(c, {}).get("levels", [])}
                  for c in ("eagle", "baseline")}
        routers = {name: {lv["concurrency"]: lv for lv in data.get("levels", [])}
                   for name, data in configs.items()
                   if name.startswith("router") and isinstance(data, dict)}
        for c in sorted(set(static["eagle"]) | set(static["baseline"])):
            e, b = static["eagle"].get(c), static["baseline"].get(c)
            row: dict[str, Any] = {"concurrency": c}
            candidates = [lv for lv in (e, b) if lv is not None]
            best_tput = max(lv["output_tok_s"] for lv in candidates)
            best_lat = min(lv["e2e"]["p50"] for lv in candidates)
            row["best_throughput_pool"] = max(
                (("eagle", e), ("baseline", b)),
                key=lambda kv: kv[1]["output_tok_s"] if kv[1] else -1.0)[0]
            row["best_throughput"] = best_tput
            row["best_median_latency"] = best_lat
            row["routers"] = {}
            for name, by_level in routers.items():
                r = by_level.get(c)
                if r is None or best_tput <= 0 or best_lat <= 0:
                    continue
                tr, lr = r["output_tok_s"] / best_tput, r["e2e"]["p50"] / best_lat
                row["routers"][name] = {
                    "throughput_ratio": tr, "latency_ratio": lr,
                    "meets_throughput": tr >= THROUGHPUT_TARGET,
                    "meets_latency": lr <= LATENCY_TARGET, "pools": r.get("by_pool", {})}
            rows.append(row)
        table[profile] = rows
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)))
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"any of {','.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--no-calibrate", action="store_true",
                        help="router variants with the default policy, no calibrate run")


def settings_from_args(args: argparse.Namespace) -> SweepSettings:
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}: use {','.join(CONFIGS)}")
    return SweepSettings(
        profiles=[p for p in args.profiles.split(",") if p],
        levels=[int(x) for x in args.levels.split(",") if x],
        configs=configs, time_scale=args.time_scale, rounds=args.rounds,
        min_requests=args.min_requests, input_tokens=args.input_tokens,
        calibrate=not args.no_calibrate,
        output_tokens=args.output_tokens, seed=args.seed, progress=not args.no_progress,
        out_dir=args.out)


DEFAULT_TIME_SCALE = 0.1


def main(args: argparse.Namespace) -> dict[str, Any]:
    s = settings_from_args(args)
    if args.quick:
        s.levels, s.rounds, s.min_requests, s.output_tokens = [1, 8], 1, 4, 64
    return run_sweep(s)
