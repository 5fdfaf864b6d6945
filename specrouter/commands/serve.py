"""`specrouter serve`: run the router under uvicorn.

CLI flags sit on top of environment variables and the config file (see
`specrouter.config`). Backends on the command line use one flag each:

    --backend name=e0,url=http://127.0.0.1:30000,pool=eagle,group=gpu0

An `api_key=` may be given there too, but the command line is visible to every user of
the host: prefer the config file or `SPECROUTER_BACKENDS` for keys (and
`SPECROUTER_REDIS_URL` for a Redis password).

`--workers N` runs N uvicorn worker processes sharing one listening socket. Every process
builds its own app (`app_from_env`, an import-string factory, which is what uvicorn's
multi-process mode needs) from the same config file and CLI flags, handed over in the
`SPECROUTER_SERVE_SOURCE` environment variable; workers share policy and load through
Redis, so more than one worker without a Redis URL is refused. Their `/metrics` is one
view over all of them (see `specrouter.control.metrics`): `serve` gives the workers a
fresh PROMETHEUS_MULTIPROC_DIR (inside the one set in the environment, if any) and
removes it when they have stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from specrouter.commands.descriptors import (
    DescriptorBudgetError,
    fit_descriptor_budget,
    merge_overrides,
)
from specrouter.config import ConfigError, Settings, load_settings, parse_backend_spec
from specrouter.control.metrics import MULTIPROC_ENV, shared_metrics_dir
from specrouter.edge import Lifecycle, accept, guard

log = logging.getLogger("specrouter.commands.serve")

#: How `serve` hands the settings' sources to `app_from_env` in each process.
SOURCE_ENV = "SPECROUTER_SERVE_SOURCE"

BACKEND_METAVAR = "name=N,url=URL,pool=eagle|baseline,group=G[,api_key=K]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="YAML or TOML config file (also: SPECROUTER_CONFIG)")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument("--backend", action="append", metavar=BACKEND_METAVAR,
                        help="one SGLang server; repeat the flag for each (replaces the "
                             "backends of the config file and environment)")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--access-log", action="store_true", default=None,
                        help="log every request (off by default: it costs CPU per request)")
    parser.add_argument("--max-body-bytes", type=int, help="request body limit (default 32 MiB)")
    parser.add_argument("--policy-file", metavar="FILE",
                        help="initial routing policy, JSON or YAML (e.g. written by "
                             "`specrouter calibrate --write-policy`); replaces `policy:` of "
                             "the config file")
    parser.add_argument("--mode", choices=["auto", "eagle", "baseline"],
                        help="policy mode: auto (the strategy decides), or force one pool")
    parser.add_argument("--router", choices=["load_aware", "prefer_eagle"],
                        help="routing implementation (default load_aware)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="uvicorn worker processes (default 1, also SPECROUTER_WORKERS); "
                             "more than one needs a Redis URL")
    parser.add_argument("--redis-url", metavar="URL",
                        help="share state with other replicas through Redis (redis:// or "
                             "rediss://); prefer SPECROUTER_REDIS_URL for a URL with a password")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI flags that were given, shaped like `Settings` (nested sections)."""
    overrides: dict[str, Any] = {}
    listen = {
        key: value for key, value in (
            ("host", args.host), ("port", args.port),
            ("log_level", args.log_level), ("access_log", args.access_log),
        ) if value is not None
    }
    if listen:
        overrides["listen"] = listen
    if args.backend:
        overrides["backends"] = [parse_backend_spec(spec) for spec in args.backend]
    if args.max_body_bytes is not None:
        overrides["limits"] = {"max_body_bytes": args.max_body_bytes}
    policy = _read_policy_file(args.policy_file) if getattr(args, "policy_file", None) else {}
    if getattr(args, "mode", None):
        policy["mode"] = args.mode
    if policy:
        overrides["policy"] = policy
    if getattr(args, "router", None):
        overrides["router"] = args.router
    if getattr(args, "workers", None) is not None:
        overrides["workers"] = args.workers
    if getattr(args, "redis_url", None):
        overrides["redis_url"] = args.redis_url
    return overrides


def _read_policy_file(path: str) -> dict[str, Any]:
    """A policy document (JSON or YAML object); a `policy:` wrapper is accepted too."""
    import yaml  # JSON is YAML: one parser for both

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"policy file {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("policy"), dict):
        data = data["policy"]
    if not isinstance(data, dict):
        raise ConfigError(f"policy file {path}: expected a JSON/YAML object")
    return dict(data)


def uvicorn_config(settings: Settings, app: Any) -> uvicorn.Config:
    """uvicorn with uvloop and httptools: the pure-Python h11 parser alone costs more
    than the router's whole latency budget at high request rates."""
    return uvicorn.Config(app, **uvicorn_options(settings))


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    limits = settings.limits
    guard.apply_limits(limits.max_header_bytes, limits.header_timeout_s)
    return dict(
        host=settings.listen.host,
        port=settings.listen.port,
        # uvloop, accepting a burst of new connections in one turn (edge/accept.py)
        loop=accept.LOOP,
        # httptools plus request-head size and time limits (slowloris, huge headers) and
        # the connection limit enforced at accept (the descriptor budget).
        http=guard.PROTOCOL,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_timeout_s,
        lifespan="on",
        access_log=settings.listen.access_log,
        log_level=settings.listen.log_level,
        server_header=False,
        # No X-Forwarded-* rewriting: it would run on every request, and the router
        # does not use the client address.
        proxy_headers=False,
        # Without a drain (`specrouter demo`), uvicorn's own graceful shutdown waits for
        # requests in progress.
        timeout_graceful_shutdown=max(1.0, settings.shutdown.drain_timeout_s),
    )


def describe(settings: Settings) -> str:
    """One line per backend for the start-up log; API keys are never shown."""
    lines = [f"specrouter listening on http://{settings.listen.host}:{settings.listen.port}"]
    state = settings.state_settings()
    if state.redis_url is not None:
        lines.append(f"  shared state: redis {state.redacted_url} (prefix {state.key_prefix}), "
                     f"{settings.workers} worker(s)")
    for b in settings.backends:
        key = " (api key set)" if b.api_key is not None else ""
        lines.append(f"  backend {b.name}: {b.pool} in group {b.group} at {b.url}{key}")
    return "\n".join(lines)


def _setup_logging(settings: Settings) -> None:
    logging.basicConfig(level=settings.listen.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every telemetry poll and health check at INFO: ten lines a second.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def serve(settings: Settings, config_file: str | None = None,
          overrides: dict[str, Any] | None = None) -> None:
    """One process, or `settings.workers` worker processes; each builds its app with
    `app_from_env` from the same sources. Raises DescriptorBudgetError when the descriptor
    limit cannot hold even a minimal set of connections."""
    _setup_logging(settings)
    budget = fit_descriptor_budget(settings)  # workers inherit the raised limit
    settings = budget.apply(settings)
    overrides = merge_overrides(overrides or {}, budget.overrides())
    log.info("%s", describe(settings))
    for warning in (settings.state_settings().password_warning,
                    settings.admin_token_warning):
        if warning is not None:
            log.warning("%s", warning)
    os.environ[SOURCE_ENV] = json.dumps({"config": config_file, "overrides": overrides or {}})
    options = uvicorn_options(settings)
    options["timeout_graceful_shutdown"] = 1.0  # the drain already waited
    if settings.workers <= 1 and not os.environ.get(MULTIPROC_ENV):
        _run_one(uvicorn.Config(APP_FACTORY, factory=True, **options))
        return
    # Workers share their metrics through files in a directory of this start only.
    with shared_metrics_dir():
        if settings.workers <= 1:
            _run_one(uvicorn.Config(APP_FACTORY, factory=True, **options))
        else:
            uvicorn.run(APP_FACTORY, factory=True, workers=settings.workers, **options)


def _run_one(config: uvicorn.Config) -> None:
    """One server process until it has shut down. uvicorn raises a SIGINT it handled again
    once it has shut down, and asyncio's runner may turn that into KeyboardInterrupt;
    the process then ends quietly, as `uvicorn.run` ends it."""
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()


def app_from_env() -> Any:
    """The app of one process (`uvicorn ... --factory`), from the config file and flags
    in SPECROUTER_SERVE_SOURCE (already validated by `run`). uvicorn calls it in its event
    loop after installing its signal handlers, which the drain then wraps."""
    from specrouter.assembly import build_product
    from specrouter.edge.collector import tune_collector

    source = json.loads(os.environ.get(SOURCE_ENV) or "{}")
    settings = load_settings(source.get("config"), source.get("overrides") or {})
    _setup_logging(settings)
    product = build_product(settings)
    _drain_on_signals(product.app.lifecycle, settings.shutdown.drain_timeout_s)
    tune_collector()
    return product.asgi


APP_FACTORY = f"{__name__}:app_from_env"
_DRAINS: set[asyncio.Task[None]] = set()  # strong references to running drain tasks


def _drain_on_signals(lifecycle: Lifecycle, drain_timeout_s: float) -> None:
    """Drain before uvicorn's shutdown.

    The first SIGTERM/SIGINT sets `lifecycle.draining`: `/ready` answers 503 (a load
    balancer stops sending) and new requests get a 503 in OpenAI format, while the
    listener stays open so health checks still get an answer. Once no request is in
    progress, or `drain_timeout_s` has passed, uvicorn's own handler runs: connections
    closed, then the lifespan shutdown stops the router. A second SIGINT skips the rest of
    the drain; a repeated SIGTERM (a supervisor forwarding one the process group already
    got) does not.
    """
    if drain_timeout_s <= 0:
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        original = signal.getsignal(sig)
        if callable(original):
            signal.signal(sig, _draining_handler(loop, lifecycle, drain_timeout_s, original))


def _draining_handler(loop: asyncio.AbstractEventLoop, lifecycle: Lifecycle,
                      drain_timeout_s: float, original: Any) -> Any:
    """The first signal drains, then hands the signal to uvicorn (`original`). A second
    SIGINT hands it over at once, and the drain's end then does not hand it over again:
    uvicorn takes a second SIGINT as a forced exit, which skips the lifespan shutdown
    (the router's pollers, its state store). A third forces the exit."""
    told = False  # uvicorn's handler has run

    def tell_uvicorn(sig: int, frame: FrameType | None) -> None:
        nonlocal told
        told = True
        original(sig, frame)

    def after_drain(sig: int, frame: FrameType | None) -> None:
        if not told:
            tell_uvicorn(sig, frame)

    def handler(sig: int, frame: FrameType | None) -> None:
        if not lifecycle.draining:
            lifecycle.draining = True
            loop.call_soon_threadsafe(_start_drain, lifecycle, drain_timeout_s, after_drain,
                                      sig)
        elif sig == signal.SIGINT:
            tell_uvicorn(sig, frame)

    return handler


def _start_drain(lifecycle: Lifecycle, drain_timeout_s: float, original: Any, sig: int) -> None:
    task = asyncio.ensure_future(_drain_then_exit(lifecycle, drain_timeout_s, original, sig))
    _DRAINS.add(task)
    task.add_done_callback(_DRAINS.discard)


async def _drain_then_exit(lifecycle: Lifecycle, drain_timeout_s: float, original: Any,
                           sig: int) -> None:
    deadline = time.monotonic() + drain_timeout_s
    log.info("draining: /ready is 503, new requests refused, %d in progress (up to %.0f s)",
             lifecycle.active, drain_timeout_s)
    while lifecycle.active and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if lifecycle.active:
        log.warning("drain timeout: %d request(s) still in progress are cut", lifecycle.active)
    else:
        log.info("drained: no request in progress")
    original(sig, None)


def run(args: argparse.Namespace) -> int:
    try:
        overrides = overrides_from_args(args)
        settings = load_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"specrouter serve: {exc}", file=sys.stderr)
        return 2
    try:
        serve(settings, args.config, overrides)
    except DescriptorBudgetError as exc:
        print(f"specrouter serve: refused: {exc}", file=sys.stderr)
        return 2
    return 0
