"""`specrouter sim`: simulated SGLang servers for one GPU group (or one engine)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any

from specrouter.sim.profile import ProfileError, load_profile
from specrouter.sim.server import EngineSpec, serve_group
from specrouter.sim.version import DEFAULT_VERSION, VERSIONS, get_version

API_KEY_ENV = "SPECROUTER_SIM_API_KEY"
VERSION_ENV = "SPECROUTER_SIM_SGLANG_VERSION"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group", default="gpu0", help="GPU group name (labels and logs)")
    parser.add_argument("--eagle-port", type=int, help="port of the EAGLE-3 engine")
    parser.add_argument("--baseline-port", type=int, help="port of the baseline engine")
    parser.add_argument("--single", choices=("eagle", "baseline", "adaptive"),
                        help="run one engine alone on --port (it has the GPU to itself); "
                        "adaptive: one EAGLE-3 engine with SGLang 0.5.23's "
                        "--speculative-adaptive and the memory of a whole pair")
    parser.add_argument("--port", type=int, help="port for --single")
    parser.add_argument("--profile", default="seed-coding",
                        help="shipped profile name (seed-coding, h200-llama3-8b) or a .json path")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="real seconds per simulated second (0.1 runs 10x faster)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"require Authorization: Bearer KEY (default: ${API_KEY_ENV}; "
                        "prefer the variable, a command line is visible to other users)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="override the profile's batch-slot limit on every engine")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="refuse requests when this many wait (SGLang's option: 503, or "
                        "an SSE error event on a stream)")
    parser.add_argument("--sglang-version", default=os.environ.get(VERSION_ENV) or DEFAULT_VERSION,
                        help=f"the SGLang release to imitate: {', '.join(sorted(VERSIONS))} "
                        f"(default: ${VERSION_ENV}, else {DEFAULT_VERSION})")
    parser.add_argument("--enable-cache-report", action="store_true",
                        help="SGLang's option: OpenAI usage carries "
                        "prompt_tokens_details.cached_tokens")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool of every engine in tokens (SGLang's option), replacing "
                        "the profile's kv_capacity_tokens; it bounds the prefix cache")
    parser.add_argument("--eagle-max-total-tokens", type=int, default=None,
                        help="KV pool of the EAGLE-3 engine only (the memory split of a pair)")
    parser.add_argument("--baseline-max-total-tokens", type=int, default=None,
                        help="KV pool of the baseline engine only")
    parser.add_argument("--enable-priority-scheduling", action="store_true",
                        help="SGLang's option: /metrics adds priority labels (the queue gauges "
                        "as a total under priority=\"\" plus one series per priority)")


def _specs(args: argparse.Namespace) -> list[EngineSpec]:
    if args.single:
        if args.port is None:
            raise ValueError("--single needs --port")
        return [EngineSpec(args.single, args.port)]
    if args.eagle_port is None or args.baseline_port is None:
        raise ValueError("give --eagle-port and --baseline-port, or --single KIND --port P")
    if args.eagle_port == args.baseline_port:
        raise ValueError("--eagle-port and --baseline-port must differ")
    return [EngineSpec("eagle", args.eagle_port), EngineSpec("baseline", args.baseline_port)]


def _pools(args: argparse.Namespace, specs: list[EngineSpec]) -> dict[str, int]:
    pools: dict[str, int] = {}
    for spec in specs:
        value = getattr(args, f"{spec.kind}_max_total_tokens", None) or args.max_total_tokens
        if value is not None:
            if value < 1:
                raise ValueError("--max-total-tokens values must be >= 1")
            pools[spec.kind] = value
    return pools


def run(args: argparse.Namespace) -> int:
    try:
        specs = _specs(args)
        pools = _pools(args, specs)
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        profile = load_profile(args.profile)
        version = get_version(args.sglang_version)
        if args.single == "adaptive" and not version.has_adaptive_speculation:
            raise ValueError(f"SGLang {version.name} has no --speculative-adaptive")
    except (ValueError, ProfileError) as exc:
        print(f"specrouter sim: {exc}", file=sys.stderr)
        return 2
    try:
        _run_loop(serve_group(profile, specs, host=args.host, group=args.group,
                           time_scale=args.time_scale, seed=args.seed, api_key=args.api_key,
                           served_model_name=args.served_model_name,
                           max_queued_requests=args.max_queued_requests,
                           max_running_requests=args.max_running_requests,
                           version=version,
                           priority_scheduling=args.enable_priority_scheduling,
                           enable_cache_report=args.enable_cache_report,
                           max_total_tokens=pools))
    except OSError as exc:
        print(f"specrouter sim: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    """uvloop when installed (several times faster at many concurrent streams)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - non-Linux
        asyncio.run(main)
        return
    uvloop.run(main)
