"""`alternatives`: the router under granian, and with an aiohttp transport, against the default.

    python -m loadtest alternatives [--quick] [--rounds 2] [--seconds 5]

One run, one simulated engine (`overhead`'s zero-prefill profile), phases rotated direct /
specrouter (uvicorn + httptools + uvloop, native transport) / granian (the same app under
`granian --interface asgi --loop uvloop --workers 1`, native transport) / aiohttp (uvicorn,
the aiohttp client of `loadtest.alt_transport` as every backend's transport), at 16 and
100 connections: CPU per streamed request (the server's process and its children), added
TTFT p50/p99 against direct, and 1-token requests/s. A path whose package is missing
(`pip install '.[bench]'`) is left out and named in `missing`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest import server_safety
from loadtest.metrics import write_json
from loadtest.procs import Stack, served_model
from loadtest.promptset import RequestShape
from loadtest.scenarios import overhead
from loadtest.scenarios.common import run_async

DEFAULT_TIME_SCALE = 1.0
LEVELS = (16, 100)
GRANIAN = "granian"
AIOHTTP = "aiohttp"


def _serve_env(engine_url: str) -> dict[str, str]:
    return {"SPECROUTER_BACKENDS": json.dumps(overhead.one_backend(engine_url)),
            "SPECROUTER_LISTEN__LOG_LEVEL": "warning"}


def granian_app() -> Any:
    """The app of `specrouter serve` for granian's factory loader, which calls it before
    any event loop runs: `app_from_env` installs its drain on SIGTERM from inside uvicorn's
    loop, so here the app is built without it (granian's own shutdown applies)."""
    from specrouter.assembly import build_product
    from specrouter.commands.serve import _setup_logging
    from specrouter.config import load_settings

    settings = load_settings(None, {})
    _setup_logging(settings)
    return build_product(settings).asgi


def start_granian(stack: Stack, engine_url: str, env: dict[str, str] | None = None
                  ) -> tuple[str, int]:
    """The app `specrouter serve` builds, under granian with one worker."""
    server = stack.http_server("granian", lambda port: [
        sys.executable, "-m", "granian", "--interface", "asgi", "--loop", "uvloop",
        "--workers", "1", "--http", "1", "--no-ws", "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "warning", "--factory",
        f"{__name__}:granian_app"], env={**_serve_env(engine_url), **(env or {})})
    return server.url, server.child.pid


def start_aiohttp(stack: Stack, engine_url: str) -> tuple[str, int]:
    """`specrouter serve` with `loadtest.alt_transport`'s aiohttp client to the engine."""
    server = stack.http_server("aiohttp", lambda port: [
        sys.executable, "-m", "loadtest.alt_transport", "serve", "--host", "127.0.0.1",
        "--port", str(port)], env=_serve_env(engine_url))
    return server.url, server.child.pid


STARTERS: dict[str, tuple[str, overhead.RouterStarter]] = {
    GRANIAN: ("granian", start_granian), AIOHTTP: ("aiohttp", start_aiohttp)}


def available() -> tuple[list[str], list[str]]:
    """(paths whose package is installed, paths whose package is missing)."""
    have = [name for name, (mod, _) in STARTERS.items() if importlib.util.find_spec(mod)]
    return have, [name for name in STARTERS if name not in have]


def compare(s: overhead.OverheadSettings, names: list[str],
            levels: tuple[int, ...] = LEVELS) -> dict[str, Any]:
    """`overhead.side_by_side`'s rotation over direct, specrouter and each of `names`."""
    profile = overhead.zero_cost_profile(s.step_cost_factor)
    with Stack() as stack:
        sim = stack.sim_group("gpu0", str(profile), s.time_scale, s.seed)
        engine = sim.urls()[s.pool]
        model = served_model(engine)
        paths = {overhead.DIRECT: (engine, sim.child.pid),
                 overhead.SPECROUTER: overhead.start_specrouter(stack, engine, s.router_env)}
        for name in names:
            paths[name] = STARTERS[name][1](stack, engine)
        shape = RequestShape(model, s.input_tokens, s.output_tokens)
        one_token = RequestShape(model, 16, 1)
        out: list[dict[str, Any]] = []
        for concurrency in levels:
            streams = overhead._warmed_rotation(s, paths, shape, concurrency, s.seconds,
                                                s.think_s)
            rate = overhead._rotate(s, paths, one_token, concurrency, 1, s.rate_seconds, 0.0)
            direct, ours = streams[overhead.DIRECT], streams[overhead.SPECROUTER]
            for name, figures in streams.items():
                for q in ("p50", "p99"):
                    figures[f"added_{q}_ms"] = figures[f"ttft_{q}_ms"] - direct[f"ttft_{q}_ms"]
                figures["cpu_vs_specrouter"] = (figures["cpu_ms_per_request"]
                                                / max(1e-9, ours["cpu_ms_per_request"]))
                rate[name]["vs_specrouter"] = (rate[name]["req_s"] / max(
                    1e-9, rate[overhead.SPECROUTER]["req_s"]))
            out.append({"concurrency": concurrency, "streams": streams, "rate": rate})
    return {"settings": asdict(s), "levels": out, "paths": list(paths)}


def table(result: dict[str, Any]) -> list[str]:
    """One markdown row per level and path."""
    lines = ["| connections | path | added TTFT p50 ms | added TTFT p99 ms | CPU ms/request "
             "| CPU vs specrouter | 1-token req/s | req/s vs specrouter | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for level in result.get("levels", []):
        for name in result["paths"]:
            st, rt = level["streams"][name], level["rate"][name]
            lines.append(
                f"| {level['concurrency']} | {name} | {st['added_p50_ms']:.3f} | "
                f"{st['added_p99_ms']:.3f} | {st['cpu_ms_per_request']:.3f} | "
                f"{st['cpu_vs_specrouter']:.2f} | {rt['req_s']:.0f} | "
                f"{rt['vs_specrouter']:.2f} | {st['errors'] + rt['errors']} |")
    return lines


SAFETY_ENV = {"SPECROUTER_LIMITS__MAX_BODY_BYTES": str(1024 * 1024)}


async def _probe_all(url: str, pid: int, model: str) -> dict[str, Any]:
    head, body, slow = await asyncio.gather(
        server_safety.oversized_head(url),
        server_safety.oversized_body(url, model, int(SAFETY_ENV[
            "SPECROUTER_LIMITS__MAX_BODY_BYTES"])),
        server_safety.slowloris(url))
    return {"oversized_head": head, "oversized_body": body,
            "slowloris_closed_after_s": None if slow is None else round(slow, 2),
            "drain": await server_safety.drain(url, model, pid)}


def safety(s: overhead.OverheadSettings, names: list[str]) -> dict[str, Any]:
    """`server_safety`'s probes against specrouter under uvicorn and under granian (a
    1 MiB body limit; the drain probe stops each server)."""
    profile = overhead.zero_cost_profile(s.step_cost_factor)
    out: dict[str, Any] = {}
    with Stack() as stack:
        sim = stack.sim_group("gpu0", str(profile), s.time_scale, s.seed)
        engine = sim.urls()[s.pool]
        model = served_model(engine)
        servers = [overhead.SPECROUTER, *(n for n in names if n == GRANIAN)]
        for name in servers:
            url, pid = (start_granian(stack, engine, SAFETY_ENV) if name == GRANIAN
                        else overhead.start_specrouter(stack, engine, SAFETY_ENV))
            out[name] = run_async(_probe_all(url, pid, model))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    overhead.add_arguments(parser)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)),
                        help="comma-separated connection counts")
    parser.add_argument("--safety", action="store_true",
                        help="the safety probes (head and body limits, slowloris, drain on "
                             "SIGTERM) instead of the measurement")


def main(args: argparse.Namespace) -> dict[str, Any]:
    s = overhead.settings_from_args(args)
    have, missing = available()
    levels = tuple(int(x) for x in str(args.levels).split(",") if x.strip())
    result: dict[str, Any] = {"scenario": "alternatives", "missing": missing}
    if args.safety:
        result["summary"] = result["safety"] = safety(s, have)
    else:
        result.update(compare(s, have, levels))
        result["summary"] = {"table": table(result), "missing": missing}
    if s.out_dir:
        Path(s.out_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(s.out_dir) / "alternatives.json", result)
    return result
