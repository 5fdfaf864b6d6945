"""The processes a scenario needs: simulated GPU groups, routers, a peer router.

Each scenario starts what it measures on free loopback ports and stops it afterwards,
so one command gives a complete, repeatable run. Output of every child goes to a temp
file (an undrained pipe would block a chatty child) and is shown when it fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
import psutil

from loadtest import loopback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll `url` until it answers below 500; fail early if `proc` died meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited early (rc {proc.returncode}) while waiting for {url}")
        try:
            if loopback.get(url, timeout=2.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f}s")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process and all its children (uvicorn workers),
    read from /proc through psutil: what it ran itself, and what the kernel ran for it
    (its system calls, and the loopback TCP work they do)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    user = system = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        user += t.user
        system += t.system
    return user, system


@dataclass
class Child:
    """One started process and its log."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    def start(self) -> Child:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self, tail: int = 4000) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-tail:]

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        """`wait_http` on this child; a failure also shows the child's log."""
        assert self.proc is not None
        try:
            wait_http(url, self.proc, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: {exc}:\n{self.output()}") from None

    def stop(self, timeout: float = 10.0) -> None:
        try:
            self._terminate(timeout)
        finally:
            if self.log is not None:
                self.log.close()
                self.log = None

    def _terminate(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)
        except ProcessLookupError:
            pass


def specrouter_argv(*args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "specrouter", *args]


@dataclass
class SimGroup:
    group: str
    eagle_url: str
    baseline_url: str
    child: Child

    def backends(self) -> list[dict[str, str]]:
        """This group as router backends (the `SPECROUTER_BACKENDS` shape)."""
        return [
            {"name": f"{self.group}-eagle", "url": self.eagle_url, "pool": "eagle",
             "group": self.group},
            {"name": f"{self.group}-baseline", "url": self.baseline_url, "pool": "baseline",
             "group": self.group},
        ]

    def urls(self) -> dict[str, str]:
        return {"eagle": self.eagle_url, "baseline": self.baseline_url}


@dataclass
class SimEngine:
    """One simulated engine that has its GPU to itself."""

    group: str
    kind: str
    url: str
    child: Child


@dataclass
class RouterProc:
    url: str
    child: Child


class Stack:
    """Starts children and stops them all, last first, on exit (even after an error)."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()

    def start(self, child: Child) -> Child:
        self.children.append(child.start())
        return child

    def sim_group(self, group: str, profile: str, time_scale: float, seed: int = 7,
                  extra_args: Sequence[str] = ()) -> SimGroup:
        sim = self._launch_group(group, profile, time_scale, seed, extra_args)
        self._wait_group(sim)
        return sim

    def _launch_group(self, group: str, profile: str, time_scale: float, seed: int,
                      extra_args: Sequence[str]) -> SimGroup:
        eagle_port, baseline_port = free_port(), free_port()
        child = self.start(Child(f"sim {group}", specrouter_argv(
            "sim", "--group", group, "--eagle-port", str(eagle_port),
            "--baseline-port", str(baseline_port), "--profile", profile,
            "--time-scale", repr(time_scale), "--seed", str(seed), "--host", "127.0.0.1",
            *extra_args)))
        return SimGroup(group, f"http://127.0.0.1:{eagle_port}",
                        f"http://127.0.0.1:{baseline_port}", child)

    @staticmethod
    def _wait_group(sim: SimGroup) -> None:
        sim.child.wait_http(f"{sim.eagle_url}/v1/models")
        sim.child.wait_http(f"{sim.baseline_url}/v1/models")

    def sim_groups(self, count: int, profile: str, time_scale: float, seed: int = 7,
                   extra_args: Sequence[str] = ()) -> list[SimGroup]:
        """`count` simulated GPU groups, gpu0, gpu1, ... (each its own process and GPU),
        started together."""
        sims = [self._launch_group(f"gpu{i}", profile, time_scale, seed, extra_args)
                for i in range(count)]
        for sim in sims:
            self._wait_group(sim)
        return sims

    def sim_singles(self, count: int, kind: str, profile: str, time_scale: float,
                    seed: int = 7, extra_args: Sequence[str] = ()) -> list[SimEngine]:
        """`count` simulated engines gpu0, gpu1, ..., each alone on its GPU
        (`specrouter sim --single KIND`), started together."""
        engines: list[SimEngine] = []
        for i in range(count):
            port = free_port()
            child = self.start(Child(f"sim gpu{i}", specrouter_argv(
                "sim", "--group", f"gpu{i}", "--single", kind, "--port", str(port),
                "--profile", profile, "--time-scale", repr(time_scale), "--seed", str(seed),
                "--host", "127.0.0.1", *extra_args)))
            engines.append(SimEngine(f"gpu{i}", kind, f"http://127.0.0.1:{port}", child))
        for engine in engines:
            engine.child.wait_http(f"{engine.url}/v1/models")
        return engines

    def stop(self, child: Child) -> None:
        """Stop one child before the others (e.g. a router between two sweeps)."""
        child.stop()
        if child in self.children:
            self.children.remove(child)

    def http_server(self, name: str, argv: Callable[[int], list[str]],
                    env: dict[str, str] | None = None, timeout: float = 60.0) -> RouterProc:
        """A child serving HTTP on a free loopback port: `argv(port)` started, and waited
        for until its /health answers."""
        port = free_port()
        child = self.start(Child(name, argv(port), env=env or {}))
        url = f"http://127.0.0.1:{port}"
        child.wait_http(f"{url}/health", timeout)
        return RouterProc(url, child)

    def router(self, backends: list[dict[str, Any]], env: dict[str, str] | None = None,
               extra_args: Sequence[str] = (), python: str = sys.executable) -> RouterProc:
        """`specrouter serve` in front of `backends`, run by the interpreter `python`."""
        return self.http_server("specrouter serve", lambda port: specrouter_argv(
            "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *extra_args, python=python),
            env={"SPECROUTER_BACKENDS": json.dumps(backends), **(env or {})})

    def instant_upstream(self, chunks: int = 1, gap_ms: float = 0.0) -> RouterProc:
        """`loadtest.instant_upstream` on a free port: an upstream that answers at once
        (streams of `chunks` tokens, `gap_ms` apart)."""
        return self.http_server("instant upstream", lambda port: [
            sys.executable, "-m", "loadtest.instant_upstream", "--port", str(port),
            "--chunks", str(chunks), "--gap-ms", repr(gap_ms)])


def served_model(base_url: str) -> str:
    """The first model id a server lists (what requests must name)."""
    data = loopback.get(f"{base_url}/v1/models", timeout=10.0).json()
    return str(data["data"][0]["id"])


def sim_options() -> str:
    """`specrouter sim --help` (which flags and engine kinds this simulator has)."""
    done = subprocess.run(specrouter_argv("sim", "--help"), capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)
    return done.stdout


def sim_state(base_url: str) -> dict[str, Any]:
    """GET /sim/state of one simulated engine (its counters)."""
    data: dict[str, Any] = loopback.get(f"{base_url}/sim/state", timeout=10.0).json()
    return data


def flush_cache(base_url: str) -> None:
    """Empty one engine's prefix cache (SGLang's `/flush_cache`). An engine refuses while it
    is busy, e.g. answering a health check or finishing an abandoned request, so it is asked
    again for up to 30 s."""
    for _ in range(600):
        response = loopback.post(f"{base_url}/flush_cache", timeout=10.0)
        if response.status_code == 200 and "not be performed" not in response.text[:40]:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{base_url}/flush_cache: still busy after 30 s")


def reset_engines(urls: Iterable[str], seed: int) -> None:
    """Every engine starts the next run cold and with the same draws: its prefix cache
    empty and its acceptance and output-length draws reseeded from `seed`. Configs that
    replay one workload are then paired: none inherits the prefixes another one cached,
    and they differ by what they do, not by their luck."""
    for url in urls:
        flush_cache(url)
        sim_control(url, {"seed": seed})


def sim_control(base_url: str, fields: dict[str, Any]) -> None:
    """POST /sim/control on one simulated engine (faults, accept length)."""
    response = loopback.post(f"{base_url}/sim/control", json=fields, timeout=10.0)
    if response.status_code >= 300:
        raise RuntimeError(f"{base_url}/sim/control {fields}: HTTP {response.status_code} "
                           f"{response.text[:200]}")
