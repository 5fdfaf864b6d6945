"""launch-pair driving the SGLang simulator (single-engine mode) as both servers."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.procs import ManagedProcess, free_port, specrouter_argv, wait_until

SIM = str(Path(__file__).with_name("sim_as_sglang.py"))


def test_launch_pair_runs_two_simulated_servers(process_factory) -> None:
    eagle_port, baseline_port = free_port(), free_port()
    sim = f"{sys.executable} {SIM} --role %s"
    proc = ManagedProcess(specrouter_argv(
        "launch-pair", "--gpu-mem-gib", "139.8", "--model-gib", "14.96", "--draft-gib", "0.8",
        "--model-shape", "llama3-8b", "--eagle-kv-tokens", "200000",
        "--eagle-port", str(eagle_port), "--baseline-port", str(baseline_port),
        "--eagle-cmd", sim % "eagle", "--baseline-cmd", sim % "baseline",
    )).start()
    process_factory.append(proc)
    wait_until(lambda: "pair is up" in proc.output(), 90, "both simulated servers ready")
    for port in (eagle_port, baseline_port):
        models = loopback.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert models["object"] == "list" and models["data"]
    proc.signal(signal.SIGTERM)
    assert proc.proc is not None and proc.proc.wait(60) == 0
    for port in (eagle_port, baseline_port):  # both servers are gone, not just the launcher
        with pytest.raises(httpx.TransportError):
            loopback.get(f"http://127.0.0.1:{port}/health", timeout=2)
