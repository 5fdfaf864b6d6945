"""`specrouter demo`: the printed curl line and openai snippet work as printed; Ctrl-C
stops the router and the simulator."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.procs import ManagedProcess, free_port, specrouter_argv, wait_until


def test_demo_commands_work_as_printed_and_ctrl_c_stops_everything(
    process_factory: list[ManagedProcess],
) -> None:
    port = free_port()
    demo = ManagedProcess(specrouter_argv("demo", "--port", str(port), "--time-scale", "0.05"))
    process_factory.append(demo.start())
    wait_until(lambda: "Press Ctrl-C to stop" in demo.output() and len(_engines(demo)) == 2,
               60, "the demo banner and the simulator's ready line")
    out = demo.output()

    curl = next(line.strip() for line in out.splitlines() if line.strip().startswith("curl "))
    streamed = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0 and streamed.stdout.rstrip().endswith("data: [DONE]")

    snippet = out[out.index("from openai import OpenAI"):out.index("Response headers")]
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip()

    engines = _engines(demo)
    demo.signal(signal.SIGINT)
    assert demo.proc is not None and demo.proc.wait(30) == 0
    assert "Traceback" not in demo.output(), demo.output()[-3000:]  # a clean Ctrl-C
    for url in (f"http://127.0.0.1:{port}", *engines):
        try:
            loopback.get(f"{url}/health", timeout=1.0)
            raise AssertionError(f"{url} still answers after Ctrl-C")
        except httpx.ConnectError:
            pass


def _engines(demo: ManagedProcess) -> list[str]:
    """The simulated engines' URLs, from the simulator's ready line (the simulator and
    the router print theirs from two processes, in either order)."""
    return re.findall(r"(?:eagle|baseline)=(http://127\.0\.0\.1:\d+)", demo.output())


def _refuses(url: str) -> bool:
    try:
        loopback.get(f"{url}/health", timeout=1.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_demo_stopped_by_a_signal_leaves_no_simulator_behind(
    process_factory: list[ManagedProcess], sig: signal.Signals,
) -> None:
    port = free_port()
    demo = ManagedProcess(specrouter_argv("demo", "--port", str(port), "--time-scale", "0.05"))
    process_factory.append(demo.start())
    wait_until(lambda: "Press Ctrl-C to stop" in demo.output() and len(_engines(demo)) == 2,
               60, "the demo banner and the simulator's ready line")
    engines = _engines(demo)

    demo.signal(sig)
    assert demo.proc is not None
    code = demo.proc.wait(30)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), demo.output()[-2000:]
    for url in engines:  # a SIGKILLed demo runs no cleanup: the parent-death signal does it
        wait_until(lambda url=url: _refuses(url), 15, f"the simulator at {url} to stop")
