"""`peer`: specrouter and the SGLang model gateway (PyPI `sglang-router`) side by side.

One run, one client: `overhead.side_by_side` rotates direct, specrouter, the gateway and
the two reference relays of `loadtest.floor_proxy` (`FLOORS`) at 16, 100 and 400
connections, against upstreams that answer at once. The gateway is the
Rust router SGLang ships: `python -m sglang_router.launch_router --worker-urls URL`
(round-robin policy over the one worker; its Prometheus port is moved to a free port so
runs do not collide). When the package is missing the result says "not measured".
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.metrics import write_json
from loadtest.procs import Stack, free_port
from loadtest.scenarios import overhead

DEFAULT_TIME_SCALE = 1.0
PEER_NAME = "sglang-router (SGLang model gateway)"
PEER_KEY = "sglang-router"  # its path's name in `overhead.side_by_side`


def peer_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def peer_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-router")
    except PackageNotFoundError:
        return "not installed"


def start_sglang_router(stack: Stack, engine_url: str | Sequence[str],
                        policy: str = "round_robin") -> tuple[str, int]:
    """The gateway in front of one worker or several (`--policy round_robin`,
    `cache_aware`, ...)."""
    urls = [engine_url] if isinstance(engine_url, str) else list(engine_url)
    gateway = stack.http_server("sglang-router", lambda port: [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--worker-urls", *urls, "--policy", policy,
        "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1",
        "--log-level", "warn"], timeout=120.0)
    return gateway.url, gateway.child.pid


def floor_starter(kind: str) -> overhead.RouterStarter:
    """A starter of `loadtest.floor_proxy --kind KIND` in front of an upstream."""
    def start(stack: Stack, upstream_url: str) -> tuple[str, int]:
        floor = stack.http_server(f"floor proxy ({kind})", lambda port: [
            sys.executable, "-m", "loadtest.floor_proxy", "--kind", kind, "--port", str(port),
            "--upstream", upstream_url])
        return floor.url, floor.child.pid
    return start


#: The reference relays of `loadtest.floor_proxy`, by their path's name.
FLOORS = {
    "floor-asgi": ("asgi", "the leanest relay on specrouter's own stack (uvicorn with "
                           "httptools and uvloop, a raw ASGI app, the native transport; "
                           "`loadtest.floor_proxy`): what specrouter's own work adds is "
                           "its distance to this row"),
    "floor-protocol": ("protocol", "asyncio protocols on uvloop and httptools, no ASGI "
                                   "server and no client library (`loadtest.floor_proxy`): "
                                   "what a Python relay costs at least"),
    "floor-routed": ("routed", "floor-protocol with specrouter's router in the loop (its "
                               "polls and health checks running; each request parsed, "
                               "chosen, acquired, released and observed) and none of the "
                               "proxy's cycle (`loadtest.floor_proxy`): the routing work "
                               "on callbacks, where a request path below uvicorn's cycle "
                               "would start"),
}


def compared() -> list[tuple[str, overhead.RouterStarter]]:
    """The side-by-side's other paths: the gateway (what specrouter is judged against),
    then the floors."""
    return [(PEER_KEY, start_sglang_router),
            *((name, floor_starter(kind)) for name, (kind, _) in FLOORS.items())]


def side_by_side(s: overhead.OverheadSettings) -> dict[str, Any]:
    """The scenario's result: its paths side by side, or why it was not measured."""
    result: dict[str, Any] = {"scenario": "peer", "peer": PEER_NAME, "version": peer_version()}
    if not peer_available():
        return {**result, "measured": False,
                "why": "sglang-router is not installed (pip install '.[bench]')"}
    return {**result, "measured": True, **overhead.side_by_side(s, compared()),
            "path_notes": {name: note for name, (_, note) in FLOORS.items()}}


def main(args: argparse.Namespace) -> dict[str, Any]:
    s = overhead.settings_from_args(args)
    result = side_by_side(s)
    if s.out_dir:
        Path(s.out_dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(s.out_dir) / "peer.json", result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    overhead.add_arguments(parser)
