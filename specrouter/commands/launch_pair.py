"""`specrouter launch-pair`: start an EAGLE-3 and a baseline SGLang server on one GPU, in order.

Order matters because SGLang sizes its KV pool from the memory free *when it starts*
(see `specrouter.commands.memplan`): the second server must start only once the first has loaded
its weights and allocated its pool, i.e. once it answers ready. The pair lives and dies
together: a GPU group with one server is not what the router was told it has, so if
either exits, the other is stopped and launch-pair exits non-zero, for the container
runtime to restart the pair as one unit.

SGLang is never imported here (the proxy must not depend on it): the servers are
subprocesses, `python -m sglang.launch_server ...` by default, or any command given with
`--eagle-cmd` / `--baseline-cmd` (how the tests run the simulator in their place).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

import httpx

from specrouter.commands.children import die_with_parent
from specrouter.commands.memplan import Plan, PlanError, Role, plan_pair
from specrouter.commands.plan import (
    add_plan_arguments,
    plan_input_from_args,
    render_text,
    server_args,
)

DEFAULT_CMD = "{python} -m sglang.launch_server {sglang_args}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    launch = parser.add_argument_group("launch")
    launch.add_argument("--eagle-cmd", default=DEFAULT_CMD,
                        help="command template for the EAGLE server; fields {python} "
                             "{sglang_args} {host} {port} {mem_fraction_static}")
    launch.add_argument("--baseline-cmd", default=DEFAULT_CMD, help="same, baseline server")
    launch.add_argument("--ready-timeout", type=float, default=1800.0,
                        help="seconds a server may take to become ready (weights load)")
    launch.add_argument("--stop-timeout", type=float, default=30.0,
                        help="seconds between SIGTERM and SIGKILL when stopping a server")
    launch.add_argument("--probe-host", default="127.0.0.1", help="where to probe readiness")


@dataclass
class Server:
    role: Role
    argv: list[str]
    ready_url_base: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        _log(f"starting {self.role}: {shlex.join(self.argv)}")
        # Own process group: SGLang forks a scheduler and a detokenizer; a signal to the
        # group reaches them all. The parent-death signal (SIGTERM) stops the server when
        # launch-pair dies without cleaning up (SIGKILL), so it cannot keep holding the GPU.
        self.proc = subprocess.Popen(self.argv, start_new_session=True,
                                     preexec_fn=die_with_parent())

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def is_ready(self) -> bool:
        """`/ready` (SGLang 0.5.23+), else `/health` (older: 404 on /ready)."""
        for path in ("/ready", "/health"):
            try:
                status = httpx.get(self.ready_url_base + path, timeout=5.0).status_code
            except httpx.HTTPError:
                return False
            if status != 404:
                return status == 200
        return False


def build_command(template: str, role: Role, plan: Plan, args: argparse.Namespace) -> list[str]:
    port = args.eagle_port if role == "eagle" else args.baseline_port
    fields = {
        "python": shlex.quote(sys.executable),
        "sglang_args": shlex.join(server_args(plan, role, args)),
        "host": shlex.quote(args.host),
        "port": str(port),
        "mem_fraction_static": str(plan.by_role(role).mem_fraction_static),
    }
    try:
        return shlex.split(template.format(**fields))
    except (KeyError, IndexError, ValueError) as exc:
        raise PlanError(f"bad --{role}-cmd template {template!r}: {exc}") from None


class Supervisor:
    """Starts servers in order, forwards signals, and stops everything when one exits."""

    def __init__(self, servers: Sequence[Server], ready_timeout: float, stop_timeout: float):
        self.servers = list(servers)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.stop_requested = threading.Event()
        self.received: int | None = None

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        self.stop_requested.set()

    def run(self) -> int:
        try:
            for server in self.servers:
                server.start()
                outcome = self._wait_ready(server)
                if outcome is not None:
                    return outcome
                _log(f"{server.role} is ready")
            _log("pair is up")
            return self._watch()
        finally:
            self._stop_all()

    def _wait_ready(self, server: Server) -> int | None:
        """None when ready; else launch-pair's exit code (a death, a signal, a timeout)."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            dead = self._dead_code()
            if dead is not None:
                return dead
            if self.stop_requested.is_set():
                return self._signal_exit()
            if server.is_ready():
                return None
            self.stop_requested.wait(0.25)
        _log(f"{server.role} not ready after {self.ready_timeout:.0f}s: stopping the pair")
        return 1

    def _watch(self) -> int:
        while True:
            dead = self._dead_code()
            if dead is not None:
                return dead
            if self.stop_requested.wait(0.25):
                return self._signal_exit()

    def _dead_code(self) -> int | None:
        for server in self.servers:
            code = server.exit_code()
            if code is not None:
                _log(f"{server.role} exited with code {code}: stopping the other server")
                return code if code > 0 else 1
        return None

    def _signal_exit(self) -> int:
        received = self.received or signal.SIGTERM
        # SIGHUP (the session ended) stops the pair like SIGTERM.
        signum = signal.SIGTERM if received == signal.SIGHUP else received
        _log(f"got {signal.Signals(received).name}: sending {signal.Signals(signum).name} "
             f"to both servers")
        for server in self.servers:
            server.signal(signum)
        return 0

    def _stop_all(self) -> None:
        for server in self.servers:
            server.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for server in self.servers:
            if server.proc is None:
                continue
            try:
                server.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _log(f"{server.role} ignored SIGTERM for {self.stop_timeout:.0f}s: SIGKILL")
                server.signal(signal.SIGKILL)
                server.proc.wait()


def _log(message: str) -> None:
    print(f"launch-pair: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_pair(plan_input_from_args(args))
        commands = {
            role: build_command(getattr(args, f"{role}_cmd"), role, plan, args)
            for role in ("eagle", "baseline")
        }
    except PlanError as exc:
        _log(f"refused: {exc}")
        return 2
    _log("plan:\n" + render_text(plan, args))
    servers = []
    for server_plan in plan.servers:
        role = server_plan.role
        port = args.eagle_port if role == "eagle" else args.baseline_port
        servers.append(Server(role, commands[role], f"http://{args.probe_host}:{port}"))
    supervisor = Supervisor(servers, args.ready_timeout, args.stop_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, supervisor.on_signal)
    return supervisor.run()
