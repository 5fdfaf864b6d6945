"""`overhead`: what the router costs: added TTFT, CPU per request, highest request rate.

One simulated engine with (nearly) zero step cost, so latency is all HTTP and proxy
work. Phases alternate direct and through the router (direct, router, direct, ...) so
slow drift on the host (other work on the same 2 cores) cancels out. Reported: TTFT
p50/p90/p99 of each path and their difference, the router's CPU seconds per streamed
request (user + system from /proc), and the highest request rate it sustained with one
worker (and N workers sharing state through Redis, when `serve --workers` exists).
`side_by_side` measures specrouter and another router (the `peer` scenario: SGLang's
model gateway) in one run against one engine, at 16, 100 and 400 connections: phases
rotate direct / specrouter / peer, so every figure of one level saw the same host.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.generator import LoadGenerator
from loadtest.instant_upstream import MODEL as INSTANT_MODEL
from loadtest.metrics import RequestResult, percentile, summarize, write_json
from loadtest.procs import Child, RouterProc, Stack, free_port, served_model
from loadtest.promptset import RequestShape, load_prompts
from loadtest.scenarios.common import CpuWatch, run_async

DEFAULT_TIME_SCALE = 1.0
P50_TARGET_MS = 1.0
P99_TARGET_MS = 5.0
SIM_PROFILE_DIR = Path(__file__).resolve().parents[2] / "specrouter" / "sim" / "profiles"


# What the router fronts in a measurement (`OverheadSettings.servers`).
ONE_SERVER, EAGLE_REGIME, TWO_POOLS = "one", "eagle-regime", "two-pools"
SERVERS = (ONE_SERVER, EAGLE_REGIME, TWO_POOLS)


@dataclass
class OverheadSettings:
    concurrency: int = 100
    rounds: int = 3
    seconds: float = 6.0  # per phase
    output_tokens: int = 16
    input_tokens: int = 64
    # Prefill costs nothing and decode steps are paced: with truly zero step cost a
    # closed loop of 100 streams saturates 2 cores (measured 1,880 req/s direct, TTFT p50
    # 29 ms on both paths from CPU queueing alone), which measures the host, not the
    # router. seed-coding's decode steps at --time-scale 0.25 are ~10-20 ms real at this
    # load, leaving the cores headroom.
    step_cost_factor: float = 1.0  # the sim profile's time_factor
    time_scale: float = 0.25
    pool: str = "baseline"  # the engine both paths reach
    # Latency percentiles leave out the requests started in a phase's first `settle_s`:
    # a phase starts all its users at once, and that burst queues behind itself (at 100
    # streams its requests waited up to 34 ms through the router and 12 ms direct), so
    # without it the p99 measures the phase's start, not the streams.
    settle_s: float = 0.5
    # The side-by-side's streams: an upstream that sends `output_tokens` tokens this far
    # apart and costs next to nothing (`loadtest.instant_upstream`), as the issue's
    # reference measurement had it.
    stream_gap_ms: float = 10.0
    rate_concurrency: int = 128  # closed loop with 1-token requests for the rate test
    rate_seconds: float = 5.0
    workers: int = 2  # N for the multi-worker rate, when supported
    think_s: float = 0.02  # mean pause between a user's requests (decouples from steps)
    seed: int = 7
    progress: bool = False
    out_dir: str | None = None
    # extra router environment, e.g. {"SPECROUTER_ADMISSION__ARRIVAL_WINDOW_MS": "0"}
    router_env: dict[str, str] = field(default_factory=dict)
    # The router's servers (`SERVERS`): the engine alone, where there is nothing to
    # decide and nothing waits; or the group's two engines as a deployment has them,
    # either under a policy that keeps the group in the EAGLE-3 regime (every request
    # then waits the arrival window, since a burst could flip it: what the window costs
    # a request sent to EAGLE-3) or under the default policy (the online strategy's
    # decision on every request).
    servers: str = ONE_SERVER
    rates: bool = True  # also measure the highest request rate


def zero_cost_profile(factor: float) -> Path:
    """A copy of the seed-coding profile with no prefill cost and every decode step cost
    multiplied by `factor`, written to a temp file (the sim takes any profile path)."""
    raw = json.loads((SIM_PROFILE_DIR / "seed-coding.json").read_text(encoding="utf-8"))
    raw["step_table"] = str(SIM_PROFILE_DIR / raw["step_table"])
    raw["time_factor"] = factor * float(raw.get("time_factor", 1.0))
    raw["prefill"] = {**raw.get("prefill", {}), "base_ms": 0.0, "per_token_ms": 0.0}
    raw["name"] = "zero-prefill"
    path = Path(tempfile.mkdtemp(prefix="loadtest-")) / "zero-prefill.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


RouterStarter = Callable[[Stack, str], tuple[str, int]]


def one_backend(url: str) -> list[dict[str, str]]:
    """The router with the one engine behind it, so both paths reach the same engine
    (declared as the EAGLE pool: the router sends to EAGLE first)."""
    return [{"name": "gpu0-only", "url": url, "pool": "eagle", "group": "gpu0"}]


EAGLE_REGIME_POLICY = {"mode": "auto", "strategy": "threshold", "switch_up": 1000.0,
                       "switch_down": 999.0}
def start_specrouter(stack: Stack, engine_url: str, env: dict[str, str] | None = None,
                     spare_url: str | None = None, policy: dict[str, Any] | None = None,
                     engine_pool: str = "eagle") -> tuple[str, int]:
    """The router in front of `engine_url` (declared `engine_pool`), with `spare_url` as
    the group's other pool when given, under `policy` (None: the default)."""
    backends = one_backend(engine_url)
    backends[0]["pool"] = engine_pool
    env = dict(env or {})
    if spare_url is not None:
        backends.append({"name": "gpu0-spare", "url": spare_url,
                         "pool": "eagle" if engine_pool == "baseline" else "baseline",
                         "group": "gpu0"})
    if policy is not None:
        env.setdefault("SPECROUTER_POLICY", json.dumps(policy))
    router = stack.router(backends, env=env)
    return router.url, router.child.pid


async def _closed(url: str, shape: RequestShape, s: OverheadSettings, concurrency: int,
                  seconds: float, phase: str, think_s: float = 0.0) -> list[RequestResult]:
    async with LoadGenerator(url, shape, load_prompts(), seed=s.seed,
                             progress=s.progress) as gen:
        return await gen.closed_loop(concurrency, duration=seconds, phase=phase,
                                     think_s=think_s)


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


def added_latency(s: OverheadSettings, shape: RequestShape, direct_url: str,
                  router_url: str, router_pid: int) -> dict[str, Any]:
    run_async(_closed(direct_url, shape, s, s.concurrency, 1.0, "warm"))
    run_async(_closed(router_url, shape, s, s.concurrency, 1.0, "warm"))
    direct: list[RequestResult] = []
    routed: list[RequestResult] = []
    router_cpu = 0.0
    for _ in range(s.rounds):
        direct += run_async(_closed(direct_url, shape, s, s.concurrency, s.seconds, "direct",
                                    s.think_s))
        watch = CpuWatch({"router": router_pid})
        routed += run_async(_closed(router_url, shape, s, s.concurrency, s.seconds, "router",
                                    s.think_s))
        router_cpu += watch.cpu_used("router")
    ok_direct = [x for x in direct if x.ok]
    ok_routed = [x for x in routed if x.ok]
    settled_direct, settled_routed = _settled(ok_direct, s), _settled(ok_routed, s)
    out: dict[str, Any] = {
        "concurrency": s.concurrency,
        "requests_direct": len(ok_direct), "requests_router": len(ok_routed),
        "errors_direct": len(direct) - len(ok_direct),
        "errors_router": len(routed) - len(ok_routed),
        "router_cpu_ms_per_request": router_cpu / max(1, len(ok_routed)) * 1e3,
        "router_pools": dict(Counter(x.pool for x in ok_routed if x.pool)),
    }
    for metric in ("ttft", "ttfb"):
        d = [v for x in settled_direct if (v := getattr(x, metric)) is not None]
        r = [v for x in settled_routed if (v := getattr(x, metric)) is not None]
        for q in (0.5, 0.9, 0.99):
            label = f"p{round(q * 100)}"
            out[f"{metric}_{label}_direct_ms"] = _ms(d, q)
            out[f"{metric}_{label}_router_ms"] = _ms(r, q)
            prefix = "added" if metric == "ttft" else "added_ttfb"
            out[f"{prefix}_{label}_ms"] = _ms(r, q) - _ms(d, q)
    out["meets_p50"] = out["added_p50_ms"] < P50_TARGET_MS
    out["meets_p99"] = out["added_p99_ms"] < P99_TARGET_MS
    return out


def max_rate(s: OverheadSettings, model: str, url: str, pid: int) -> dict[str, Any]:
    """Completed requests/s of 1-token streams at high concurrency, with the CPU each
    process used: a rate reached while the router is below a full core per worker is
    a lower bound (the simulator or the load generator ran out of CPU first)."""
    shape = RequestShape(model, 16, 1)
    watch = CpuWatch({"target": pid})
    results = run_async(_closed(url, shape, s, s.rate_concurrency, s.rate_seconds, "rate"))
    shares = watch.shares()
    summary = summarize(results)
    cpu = watch.cpu_used("target")
    done = max(1, summary["completed"])
    return {"req_s": summary["req_s"], "errors": summary["errors"],
            "cpu_cores": shares, "cpu_ms_per_request": cpu / done * 1e3,
            "cpu_bound_req_s_per_core": done / cpu if cpu > 0 else None}


def serve_supports_workers() -> bool:
    help_text = subprocess.run([sys.executable, "-m", "specrouter", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    return "--workers" in help_text


def multi_worker_rate(s: OverheadSettings, model: str, engine_url: str,
                      stack: Stack) -> dict[str, Any]:
    if not serve_supports_workers():
        return {"measured": False, "why": "`specrouter serve --workers` does not exist yet"}
    redis = shutil.which("redis-server")
    if redis is None:
        return {"measured": False, "why": "no redis-server binary"}
    port = free_port()
    redis_child = stack.start(Child("redis", [redis, "--port", str(port), "--save", "",
                                              "--appendonly", "no"]))
    del redis_child
    try:
        router = stack.router(one_backend(engine_url),
                              env={"SPECROUTER_REDIS_URL": f"redis://127.0.0.1:{port}",
                                   **s.router_env},
                              extra_args=["--workers", str(s.workers)])
    except RuntimeError as exc:
        return {"measured": False, "why": f"router with --workers failed: {str(exc)[:300]}"}
    return {"measured": True, "workers": s.workers,
            **max_rate(s, model, router.url, router.child.pid)}


def measure(s: OverheadSettings, starter: RouterStarter | None = None,
            multi_worker: bool = True) -> dict[str, Any]:
    profile = zero_cost_profile(s.step_cost_factor)
    with Stack() as stack:
        sim = stack.sim_group("gpu0", str(profile), s.time_scale, s.seed)
        engine = sim.urls()[s.pool]
        spare = next(u for p, u in sim.urls().items() if p != s.pool)
        model = served_model(engine)
        if s.servers not in SERVERS:
            raise ValueError(f"servers must be one of {SERVERS}, not {s.servers!r}")
        # two pools under the default policy: each engine declared as what it is, and
        # direct goes to the one a loaded group is on (`s.pool`, the baseline)
        url, pid = (starter(stack, engine) if starter is not None else start_specrouter(
            stack, engine, s.router_env, None if s.servers == ONE_SERVER else spare,
            EAGLE_REGIME_POLICY if s.servers == EAGLE_REGIME else None,
            s.pool if s.servers == TWO_POOLS else "eagle"))
        shape = RequestShape(model, s.input_tokens, s.output_tokens)
        result: dict[str, Any] = {
            "settings": asdict(s),
            "summary": added_latency(s, shape, engine, url, pid),
        }
        if s.rates:
            result["rate_direct"] = max_rate(s, model, engine, sim.child.pid)
            result["rate_1_worker"] = max_rate(s, model, url, pid)
        if multi_worker and s.rates:
            result["rate_n_workers"] = multi_worker_rate(s, model, engine, stack)
    return result


LEVELS = (16, 100, 400)
# Streams of this many chunks over the same time as the measured ones split a streamed
# request's CPU into per chunk and per request (`chunk_split`).
SPLIT_CHUNKS = 2
DIRECT = "direct"
SPECROUTER = "specrouter"


def _settled(results: list[RequestResult], s: OverheadSettings) -> list[RequestResult]:
    """The requests a phase started after its first `settle_s` (each phase's results
    count time from its own start)."""
    return [x for x in results if x.start >= s.settle_s]


def _path_figures(results: list[RequestResult], cpu: tuple[float, float], seconds: float,
                  s: OverheadSettings) -> dict[str, Any]:
    """A path's figures over its phases; `cpu` is its process's (user, system) seconds."""
    ok = [x for x in results if x.ok]
    ttft = [x.ttft for x in _settled(ok, s) if x.ttft is not None]
    done = max(1, len(ok))
    user, system = cpu
    return {"requests": len(ok), "errors": len(results) - len(ok),
            "req_s": len(ok) / seconds,
            "cpu_ms_per_request": (user + system) / done * 1e3,
            "user_ms_per_request": user / done * 1e3,
            "sys_ms_per_request": system / done * 1e3,
            "ttft_p50_ms": _ms(ttft, 0.5), "ttft_p99_ms": _ms(ttft, 0.99)}


def _rotate(s: OverheadSettings, paths: dict[str, tuple[str, int]], shape: RequestShape,
            concurrency: int, rounds: int, seconds: float, think_s: float
            ) -> dict[str, dict[str, Any]]:
    """`rounds` phases per path at `concurrency`, the paths in turn; per path its figures
    over all its phases, CPU from its own process, and each phase's CPU per request
    (`cpu_ms_by_round`: the spread a difference between paths is read against)."""
    results: dict[str, list[RequestResult]] = {name: [] for name in paths}
    cpu = {name: (0.0, 0.0) for name in paths}
    by_round: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, (url, pid) in paths.items():
            watch = CpuWatch({name: pid})
            phase = run_async(_closed(url, shape, s, concurrency, seconds, name, think_s))
            results[name] += phase
            user, system = watch.times_used(name)
            cpu[name] = (cpu[name][0] + user, cpu[name][1] + system)
            done = max(1, sum(1 for x in phase if x.ok))
            by_round[name].append((user + system) / done * 1e3)
    return {name: {**_path_figures(results[name], cpu[name], rounds * seconds, s),
                   "cpu_ms_by_round": by_round[name]}
            for name in paths}


def _warmed_rotation(s: OverheadSettings, paths: dict[str, tuple[str, int]],
                     shape: RequestShape, concurrency: int, seconds: float, think_s: float
                     ) -> dict[str, dict[str, Any]]:
    """Each path warmed for a second at `concurrency` (connections opened, caches
    filled), then `_rotate` over `s.rounds` phases of `seconds`."""
    for url, _ in paths.values():
        run_async(_closed(url, shape, s, concurrency, 1.0, "warm"))
    return _rotate(s, paths, shape, concurrency, s.rounds, seconds, think_s)


def chunk_split(many: dict[str, Any], few: dict[str, Any], chunks: tuple[int, int]
                ) -> dict[str, float]:
    """A streamed request's CPU apart into what each chunk costs and what the request
    costs outside its chunks, user and system, in microseconds: from one path's figures
    with streams of `chunks[0]` and of `chunks[1]` chunks over the same time (so the
    same number of requests in flight, which a request's cost depends on)."""
    n_many, n_few = chunks
    out: dict[str, float] = {}
    for kind in ("user", "sys"):
        a, b = many[f"{kind}_ms_per_request"], few[f"{kind}_ms_per_request"]
        per_chunk = (a - b) / (n_many - n_few) * 1e3
        out[f"per_chunk_{kind}_us"] = per_chunk
        out[f"per_request_{kind}_us"] = b * 1e3 - n_few * per_chunk
    return out


def side_by_side(s: OverheadSettings, peers: Sequence[tuple[str, RouterStarter]],
                 levels: tuple[int, ...] = LEVELS) -> dict[str, Any]:
    """Direct, specrouter and each of `peers` (name, starter; specrouter is judged against
    the first, `judged_against`), at each level of concurrency,
    against upstreams that cost next to nothing (`loadtest.instant_upstream`), so that
    what is measured is the routers: streams of `output_tokens` tokens `stream_gap_ms`
    apart with think time (added TTFT = a router's percentile minus direct's, CPU per
    request of each router's process), and for throughput 1-token streams without think
    time (req/s and CPU per request). At the level `s.concurrency` the streams also run
    in SPLIT_CHUNKS chunks over the same time, for each path's `chunk_split`. Direct's
    CPU is the upstream's. For a level, every phase of every path ran within the same
    minute."""
    with Stack() as stack:
        def paths_to(upstream: RouterProc) -> dict[str, tuple[str, int]]:
            paths = {DIRECT: (upstream.url, upstream.child.pid),
                     SPECROUTER: start_specrouter(stack, upstream.url, s.router_env)}
            for name, start in peers:
                paths[name] = start(stack, upstream.url)
            return paths

        paths = paths_to(stack.instant_upstream(chunks=s.output_tokens,
                                                gap_ms=s.stream_gap_ms))
        # the same streams' length in SPLIT_CHUNKS chunks, for the per-chunk split
        span_ms = (s.output_tokens - 1) * s.stream_gap_ms
        split_paths = paths_to(stack.instant_upstream(
            chunks=SPLIT_CHUNKS, gap_ms=span_ms / (SPLIT_CHUNKS - 1)))
        rate_paths = paths_to(stack.instant_upstream())
        shape = RequestShape(INSTANT_MODEL, s.input_tokens, s.output_tokens)
        split_shape = RequestShape(INSTANT_MODEL, s.input_tokens, SPLIT_CHUNKS)
        one_token = RequestShape(INSTANT_MODEL, 16, 1)
        out: list[dict[str, Any]] = []
        split: dict[str, Any] = {}
        for concurrency in levels:
            streams = _warmed_rotation(s, paths, shape, concurrency, s.seconds, s.think_s)
            if concurrency == s.concurrency:
                few = _warmed_rotation(s, split_paths, split_shape, concurrency, s.seconds,
                                       s.think_s)
                chunks = (s.output_tokens, SPLIT_CHUNKS)
                split = {"concurrency": concurrency, "chunks": list(chunks),
                         "paths": {name: chunk_split(streams[name], few[name], chunks)
                                   for name in streams}}
            direct = streams[DIRECT]
            for name, figures in streams.items():
                if name != DIRECT:
                    for q in ("p50", "p99"):
                        figures[f"added_{q}_ms"] = (figures[f"ttft_{q}_ms"]
                                                    - direct[f"ttft_{q}_ms"])
            rate = _warmed_rotation(s, rate_paths, one_token, concurrency, s.rate_seconds,
                                    0.0)
            out.append({"concurrency": concurrency, "streams": streams, "rate": rate})
    base = out[0]["rate"]
    for level in out:
        for name, figures in level["rate"].items():
            figures["vs_lowest_level"] = figures["req_s"] / max(1e-9, base[name]["req_s"])
            figures["vs_direct"] = figures["req_s"] / max(1e-9, level["rate"][DIRECT]["req_s"])
    return {"settings": asdict(s), "levels": out, "paths": list(paths),
            "upstream": "instant", "chunk_split": split,
            "judged_against": peers[0][0] if peers else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="per phase")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--router-env", type=json.loads, default={}, metavar="JSON",
                        help='extra router environment, e.g. '
                             '\'{"SPECROUTER_TELEMETRY__ENABLED": "false"}\'')
    parser.add_argument("--no-rates", action="store_true",
                        help="added latency only, not the highest request rate")


def settings_from_args(args: argparse.Namespace) -> OverheadSettings:
    s = OverheadSettings(concurrency=args.concurrency, rounds=args.rounds,
                         seconds=args.seconds, workers=args.workers, seed=args.seed,
                         progress=not args.no_progress, out_dir=args.out,
                         router_env=dict(args.router_env), rates=not args.no_rates)
    if args.quick:
        s.rounds, s.seconds, s.rate_seconds = 1, 2.0, 2.0
    return s


def main(args: argparse.Namespace) -> dict[str, Any]:
    s = settings_from_args(args)
    result = {"scenario": "overhead", **measure(s)}
    if s.out_dir:
        Path(s.out_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(s.out_dir) / "overhead.json", result)
    return result


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def side_by_side_lines(result: dict[str, Any]) -> list[str]:
    """The report's table of a `side_by_side` run, and its figures against the targets:
    a router's CPU per streamed request at most the peer's, added TTFT p50/p99 under
    P50_TARGET_MS/P99_TARGET_MS at 100 streams, 1-token throughput at each level at
    least 0.9x that at the lowest level."""
    levels = result.get("levels") or []
    routers = [p for p in result.get("paths", []) if p != DIRECT]
    lines = ["### Side by side in one run: " + ", ".join(routers), "",
             "Phases rotate direct / " + " / ".join(routers) + " at each level, against "
             "upstreams that cost next to nothing (`loadtest.instant_upstream`; their own "
             "CPU in direct's rows), so what differs between the rows is the routers. "
             "Streams of 16 tokens 10 ms apart with think time, for TTFT and CPU; added "
             "TTFT = the router's percentile minus direct's in the same level, over the "
             "requests started after each phase's first 0.5 s (a phase starts all its "
             "users at once). 1-token streams without think time, for req/s: a router "
             "near one core there is what limits the rate, so the rate across levels is "
             "its own scaling with connections.",
             "",
             *_path_notes(result.get("path_notes") or {}),
             "| connections | router | added TTFT p50 ms | added TTFT p99 ms | CPU ms/request "
             "| of it user / sys | stream req/s | 1-token req/s | 1-token CPU ms/request "
             "| its CPU cores | vs lowest level | vs direct | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        for name in [DIRECT, *routers]:
            st, rt = level["streams"][name], level["rate"][name]
            lines.append(
                f"| {level['concurrency']} | {name} | {_num(st.get('added_p50_ms'), 3)} | "
                f"{_num(st.get('added_p99_ms'), 3)} | {_num(st['cpu_ms_per_request'], 3)} | "
                f"{_num(st.get('user_ms_per_request'), 3)} / "
                f"{_num(st.get('sys_ms_per_request'), 3)} | "
                f"{_num(st['req_s'], 1)} | {_num(rt['req_s'], 1)} | "
                f"{_num(rt['cpu_ms_per_request'], 3)} | "
                f"{_num(rt['req_s'] * rt['cpu_ms_per_request'] / 1e3)} | "
                f"{_num(rt['vs_lowest_level'])} | {_num(rt['vs_direct'])} | "
                f"{st['errors'] + rt['errors']} |")
    lines.append("")
    if SPECROUTER in routers and len(routers) > 1 and levels:
        peer = result.get("judged_against") or next(r for r in routers if r != SPECROUTER)
        for level in levels:
            ours = level["streams"][SPECROUTER]["cpu_ms_per_request"]
            theirs = level["streams"][peer]["cpu_ms_per_request"]
            met = "met" if ours <= theirs else "**missed**"
            scaling = level["rate"][SPECROUTER]["vs_lowest_level"]
            judged = ("" if level is levels[0] else
                      " (target >= 0.9x): " + ("met" if scaling >= 0.9 else "**missed**"))
            lines.append(f"- {level['concurrency']} connections: specrouter CPU per streamed "
                         f"request {ours:.3f} ms, {peer} {theirs:.3f} ms "
                         f"({ours / max(1e-9, theirs):.2f}x): {met}; specrouter 1-token "
                         f"throughput {scaling:.2f}x the lowest level's{judged}")
        lines.append("")
    return lines + _chunk_split_lines(result.get("chunk_split") or {}, routers)


def _path_notes(notes: dict[str, str]) -> list[str]:
    """A paragraph saying what the paths that are not routers are, if any."""
    if not notes:
        return []
    return [" ".join(f"`{name}`: {note}." for name, note in notes.items()), ""]


def _chunk_split_lines(split: dict[str, Any], routers: list[str]) -> list[str]:
    """The table of `chunk_split`: each router's CPU per chunk and per request outside
    its chunks, user and system."""
    if not split:
        return []
    many, few = split["chunks"]
    lines = [f"Where a streamed request's CPU goes, at {split['concurrency']} connections: "
             f"the streams above against streams of {few} chunks over the same time (the "
             f"same requests in flight), so (CPU at {many} chunks - CPU at {few}) / "
             f"{many - few} is a chunk's, and the rest the request's own (its parse, "
             "routing, head and connection work).",
             "",
             "| router | per chunk: user us | sys us | per request outside its chunks: "
             "user us | sys us |",
             "|---|---|---|---|---|"]
    for name in routers:
        f = split["paths"][name]
        lines.append(f"| {name} | {f['per_chunk_user_us']:.1f} | {f['per_chunk_sys_us']:.1f} "
                     f"| {f['per_request_user_us']:.1f} | {f['per_request_sys_us']:.1f} |")
    return [*lines, ""]
