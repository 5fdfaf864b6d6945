"""New connections arriving together while a router is busy: how long until each is served.

    python -m loadtest connect-burst [--busy 250] [--burst 150] [--rounds 3] [--seconds 4]

What a replica's restart does to the others (its clients reconnect at once), or a fleet of
agents starting: `burst` clients connect together while `busy` clients keep the path busy
with 1-token streams without think time. Each path (direct: the instant upstream itself;
specrouter; sglang-router when installed) runs in front of its own
`loadtest.instant_upstream`, and the paths take turns in each round. A burst request's
latency runs from its connect to the end of its response (the load generator's e2e, whose
clock starts before the connection is opened). Reported per path: the burst's p50, p99
and slowest latency, its failed requests, and the busy clients' rate.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadtest.generator import LoadGenerator
from loadtest.instant_upstream import MODEL as INSTANT_MODEL
from loadtest.metrics import RequestResult, percentile, write_json
from loadtest.procs import Stack
from loadtest.promptset import RequestShape, load_prompts
from loadtest.scenarios.common import run_async
from loadtest.scenarios.overhead import DIRECT, SPECROUTER, _num, start_specrouter
from loadtest.scenarios.peer import PEER_KEY, peer_available, start_sglang_router

DEFAULT_TIME_SCALE = 1.0
ONE_TOKEN = RequestShape(INSTANT_MODEL, 16, 1)


@dataclass
class BurstSettings:
    busy: int = 250  # clients keeping the path busy for the whole phase
    burst: int = 150  # clients connecting together, one request each
    rounds: int = 3
    seconds: float = 4.0  # of busy load per phase
    settle_s: float = 1.0  # of busy load before the burst connects
    seed: int = 7
    out_dir: str | None = None


async def _phase(url: str, s: BurstSettings) -> tuple[list[RequestResult], list[RequestResult]]:
    """The busy clients' requests and the burst's, of one phase against `url`."""
    prompts = load_prompts()
    async with LoadGenerator(url, ONE_TOKEN, prompts, seed=s.seed, progress=False) as busy, \
            LoadGenerator(url, ONE_TOKEN, prompts, seed=s.seed, progress=False) as newcomers:
        steady = asyncio.create_task(busy.closed_loop(s.busy, duration=s.seconds,
                                                      phase="busy"))
        await asyncio.sleep(s.settle_s)
        burst = await newcomers.closed_loop(s.burst, num_requests=s.burst, phase="burst")
        return await steady, burst


def _figures(busy: list[RequestResult], burst: list[RequestResult], seconds: float
             ) -> dict[str, Any]:
    latencies = [r.e2e for r in burst if r.ok and r.e2e is not None]
    return {
        "burst_requests": len(burst),
        "burst_failed": sum(1 for r in burst if not r.ok),
        "burst_p50_ms": percentile(latencies, 0.5) * 1e3 if latencies else None,
        "burst_p99_ms": percentile(latencies, 0.99) * 1e3 if latencies else None,
        "burst_max_ms": max(latencies) * 1e3 if latencies else None,
        "busy_req_s": sum(1 for r in busy if r.ok) / seconds,
    }


def run(s: BurstSettings) -> dict[str, Any]:
    """Every path's figures over all its rounds."""
    busy: dict[str, list[RequestResult]] = {}
    burst: dict[str, list[RequestResult]] = {}
    with Stack() as stack:
        direct = stack.instant_upstream()
        paths = {DIRECT: direct.url,
                 SPECROUTER: start_specrouter(stack, stack.instant_upstream().url)[0]}
        if peer_available():
            paths[PEER_KEY] = start_sglang_router(stack, stack.instant_upstream().url)[0]
        for _ in range(s.rounds):
            for name, url in paths.items():
                steady, newcomers = run_async(_phase(url, s))
                busy.setdefault(name, []).extend(steady)
                burst.setdefault(name, []).extend(newcomers)
    return {"scenario": "connect-burst", "settings": asdict(s),
            "paths": {name: _figures(busy[name], burst[name], s.rounds * s.seconds)
                      for name in paths}}


def lines(result: dict[str, Any]) -> list[str]:
    """The scenario's section of docs/benchmarks.md."""
    s = result["settings"]
    out = ["## New connections in a burst while busy (`connect-burst`)", "",
           f"{s['burst']} clients connect at once, {s['settle_s']:g} s into a phase of "
           f"{s['seconds']:g} s in which {s['busy']} clients send 1-token streams without "
           f"think time; {s['rounds']} rounds, the paths in turn. Latency: from a burst "
           "client's connect to the end of its response.", "",
           "| path | burst p50 ms | p99 ms | slowest ms | failed | busy clients' req/s |",
           "|---|---|---|---|---|---|"]
    for name, f in result["paths"].items():
        out.append(f"| {name} | {_num(f['burst_p50_ms'], 0)} | {_num(f['burst_p99_ms'], 0)} | "
                   f"{_num(f['burst_max_ms'], 0)} | {f['burst_failed']} of "
                   f"{f['burst_requests']} | {f['busy_req_s']:.0f} |")
    return [*out, ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BurstSettings()
    parser.add_argument("--busy", type=int, default=defaults.busy)
    parser.add_argument("--burst", type=int, default=defaults.burst)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--seconds", type=float, default=defaults.seconds,
                        help="of busy load per phase")


def quick(s: BurstSettings) -> BurstSettings:
    """The smoke version: a small burst, one round."""
    return replace(s, busy=20, burst=20, rounds=1, seconds=1.5)


def settings_from_args(args: argparse.Namespace) -> BurstSettings:
    s = BurstSettings(busy=args.busy, burst=args.burst, rounds=args.rounds,
                      seconds=args.seconds, seed=args.seed, out_dir=args.out)
    return quick(s) if args.quick else s


def main(args: argparse.Namespace) -> dict[str, Any]:
    s = settings_from_args(args)
    result = run(s)
    if s.out_dir:
        Path(s.out_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(s.out_dir) / "connect-burst.json", result)
    print("\n".join(lines(result)))
    return {**result, "summary": result["paths"]}
