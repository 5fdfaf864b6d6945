"""`specrouter launch-pair`: start an EAGLE-3 and a baseline SGLang server on one GPU, in order.

Order matters because SGLang sizes its KV pool from the memory free *when it starts*
(see `specrouter.commands.memplan`): the second server must start only once the first has loaded
its weights and allocated its pool, i.e. once it answers ready. The pair lives and dies
together: a GPU group with one server is not what the router was told it has, so if
either exits, the other is stopped and launch-pair exits non-zero, for the container
runtime to restart the pair as one unit.

SGLang is never imported here (the proxy must not depend on it): the servers are
subprocesses, `python -m sglang.launch_server <flags>`, where the program part can be
replaced with `--eagle-cmd` / `--baseline-cmd` (how the tests run stand-ins). Commands are
split like a shell splits them and never templated: the planned flags and then
`--{role}-extra-args` are appended as separate arguments, so braces or quotes in them reach
SGLang unchanged.

Each server runs in its own process group (SGLang forks a scheduler and a detokenizer).
Stopping a server always signals its whole group, also when the leader has already died
(its children may still hold the GPU), waits until the group is empty, and SIGKILLs what
is left after `--stop-timeout`.
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

GROUP_POLL_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    launch = parser.add_argument_group("launch")
    launch.add_argument("--eagle-cmd",
                        help="program that serves the EAGLE server, shell-split; its SGLang "
                             "flags are appended (default: this python -m sglang.launch_server)")
    launch.add_argument("--baseline-cmd", help="same, baseline server")
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
        """Signal the server's whole process group, whether or not its leader still runs."""
        if self.proc is not None:
            self.proc.poll()  # reap a dead leader first: a zombie would count as a member
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        """Whether any process of the server's group is left (reaping those that are ours)."""
        if self.proc is None:
            return False
        self.proc.poll()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-self.proc.pid, os.WNOHANG)[0] > 0:
                pass
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, deadline: float, stop_timeout: float) -> None:
        """Wait for the group to empty until `deadline`, then SIGKILL what is left of it."""
        while self.group_alive():
            if time.monotonic() >= deadline:
                _log(f"{self.role}: processes left {stop_timeout:.0f}s after SIGTERM: SIGKILL")
                self.signal(signal.SIGKILL)
                # bounded: a process stuck in the kernel (D state) ignores even SIGKILL
                killed_by = time.monotonic() + stop_timeout
                while self.group_alive() and time.monotonic() < killed_by:
                    time.sleep(GROUP_POLL_S)
                if self.group_alive():
                    _log(f"{self.role}: processes still left after SIGKILL; exiting anyway")
                return
            time.sleep(GROUP_POLL_S)

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


def build_command(program: str | None, role: Role, plan: Plan,
                  args: argparse.Namespace) -> list[str]:
    """The program (shell-split, not templated) followed by the server's planned flags."""
    if program is None:
        prefix = [sys.executable, "-m", "sglang.launch_server"]
    else:
        try:
            prefix = shlex.split(program)
        except ValueError as exc:
            raise PlanError(f"--{role}-cmd {program!r}: {exc}") from None
        if not prefix:
            raise PlanError(f"--{role}-cmd is empty")
    return prefix + server_args(plan, role, args)


class Supervisor:
    """Starts servers in order, forwards signals, and stops everything when one exits."""

    def __init__(self, servers: Sequence[Server], ready_timeout: float, stop_timeout: float):
        self.servers = list(servers)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.stop_requested = threading.Event()
        self.received: int | None = None
        self.forwarded = False

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
        self.forwarded = True
        return 0

    def _stop_all(self) -> None:
        if not self.forwarded:
            for server in self.servers:
                server.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for server in self.servers:
            server.stop(deadline, self.stop_timeout)


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
