"""`sweep`: closed-loop concurrency levels for eagle-only, baseline-only and the router.

Per profile one simulated GPU group is started (both engines share its simulated GPU)
and, for the router config, `specrouter serve` in front of it. eagle-only and
baseline-only go straight to that engine, so the other engine of the group sits idle,
as a static deployment of one pool per GPU would. The router config goes through the
router with its default policy, so the numbers show what a user of the product gets.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.generator import LoadGenerator
from loadtest.metrics import RequestResult, summarize, write_json, write_tagged_csv
from loadtest.procs import SimGroup, Stack, served_model
from loadtest.promptset import RequestShape, load_prompts
from loadtest.scenarios.common import CpuWatch, run_async, saturated

CONFIGS = ("eagle", "baseline", "router")
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PROFILES = ("seed-coding", "h200-llama3-8b")


@dataclass
class SweepSettings:
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    time_scale: float = 0.1
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


async def _level(url: str, pids: dict[str, int], model: str, s: SweepSettings,
                 concurrency: int) -> tuple[dict[str, Any], list[RequestResult]]:
    shape = RequestShape(model, s.input_tokens, s.output_tokens)
    async with LoadGenerator(url, shape, load_prompts(), seed=s.seed + concurrency,
                             progress=s.progress, time_scale=s.time_scale) as gen:
        watch = CpuWatch(pids)
        results = await gen.closed_loop(concurrency, num_requests=s.requests_at(concurrency),
                                        phase=f"c{concurrency}")
        shares = watch.shares()
    summary = summarize(results, time_scale=s.time_scale)
    return {"concurrency": concurrency, **summary, "cpu_cores": shares,
            "saturated": saturated(shares)}, results


def _targets(sim: SimGroup, router_url: str | None) -> dict[str, str]:
    urls = {"eagle": sim.eagle_url, "baseline": sim.baseline_url}
    if router_url is not None:
        urls["router"] = router_url
    return urls


def run_profile(profile: str, s: SweepSettings, log: Any = print) -> dict[str, Any]:
    """All configs and levels of one profile; a config that cannot start is reported."""
    out: dict[str, Any] = {}
    with Stack() as stack:
        sim = stack.sim_group("gpu0", profile, s.time_scale, s.seed)
        model = served_model(sim.eagle_url)
        router_url = router_pid = None
        if "router" in s.configs:
            try:
                router = stack.router(sim.backends(), env=s.router_env)
                router_url, router_pid = router.url, router.child.pid
            except RuntimeError as exc:
                out["router"] = {"error": str(exc)[-2000:], "levels": []}
        targets = _targets(sim, router_url)
        for config in s.configs:
            if config not in targets:
                continue
            pids = {"sim": sim.child.pid}
            if config == "router" and router_pid is not None:
                pids["router"] = router_pid
            levels: list[dict[str, Any]] = []
            all_results: list[tuple[int, RequestResult]] = []
            for c in s.levels:
                level, results = run_async(_level(targets[config], pids, model, s, c))
                levels.append(level)
                all_results.extend((c, r) for r in results)
                log(f"  {profile} {config:8s} c={c:<3d} {level['output_tok_s']:8.1f} tok/s  "
                    f"e2e p50 {level['e2e']['p50']:7.2f} s  errors {level['errors']}  "
                    f"cpu {level['cpu_cores']}")
            out[config] = {"levels": levels}
            if s.out_dir:
                _write_requests(Path(s.out_dir) / f"sweep-{profile}-{config}.csv", all_results)
    return out


def _write_requests(path: Path, rows: list[tuple[int, RequestResult]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_tagged_csv(path, [({"concurrency": c}, r) for c, r in rows])


def run_sweep(s: SweepSettings, log: Any = print) -> dict[str, Any]:
    result: dict[str, Any] = {"scenario": "sweep", "settings": asdict(s), "profiles": {}}
    for profile in s.profiles:
        log(f"sweep {profile}")
        result["profiles"][profile] = run_profile(profile, s, log)
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
        router = {lv["concurrency"]: lv for lv in configs.get("router", {}).get("levels", [])}
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
            r = router.get(c)
            if r is not None and best_tput > 0 and best_lat > 0:
                row["throughput_ratio"] = r["output_tok_s"] / best_tput
                row["latency_ratio"] = r["e2e"]["p50"] / best_lat
                row["meets_throughput"] = row["throughput_ratio"] >= THROUGHPUT_TARGET
                row["meets_latency"] = row["latency_ratio"] <= LATENCY_TARGET
                row["router_pools"] = r.get("by_pool", {})
            rows.append(row)
        table[profile] = rows
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)))
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="any of eagle,baseline,router")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=8)


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
        output_tokens=args.output_tokens, seed=args.seed, progress=not args.no_progress,
        out_dir=args.out)


DEFAULT_TIME_SCALE = 0.1


def main(args: argparse.Namespace) -> dict[str, Any]:
    s = settings_from_args(args)
    if args.quick:
        s.levels, s.rounds, s.min_requests, s.output_tokens = [1, 8], 1, 4, 64
    return run_sweep(s)
