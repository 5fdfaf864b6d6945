"""`specrouter demo` (and `make demo`): the product on a laptop, no GPU needed.

Starts one simulated GPU group (an EAGLE-3 and a baseline SGLang-compatible server from
`specrouter sim`) as a child process, and the router in this process on
127.0.0.1:8000 with embedded in-memory state, then prints a curl line and an `openai`
snippet that work as printed. Ctrl-C stops the router and the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

import httpx
import uvicorn

from specrouter.commands.children import die_with_parent
from specrouter.commands.descriptors import DescriptorBudgetError, fit_descriptor_budget
from specrouter.commands.serve import uvicorn_config
from specrouter.config import ConfigError, Settings, load_settings

GROUP = "gpu0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--profile", default="seed-coding", help="simulator profile")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="simulator time scale (below 1 runs faster than real time)")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def start_simulator(
    eagle_port: int, baseline_port: int, profile: str, time_scale: float
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "specrouter", "sim", "--group", GROUP,
        "--eagle-port", str(eagle_port), "--baseline-port", str(baseline_port),
        "--profile", profile, "--time-scale", str(time_scale),
    ]
    # Own session: Ctrl-C in the terminal reaches the router only, which then stops the
    # simulator in order (instead of both dying at once mid-request). The parent-death
    # signal stops it when the demo is killed without a chance to clean up.
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent())


def wait_for_models(url: str, sim: subprocess.Popen[bytes], timeout: float = 30.0) -> str:
    """The model id the simulated server serves, once it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sim.poll() is not None:
            raise RuntimeError(f"the simulator exited with status {sim.returncode}")
        try:
            response = httpx.get(f"{url}/v1/models", timeout=1.0)
            if response.status_code == 200:
                model: str = response.json()["data"][0]["id"]
                return model
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the simulator did not answer at {url} within {timeout:.0f}s")


def stop_simulator(sim: subprocess.Popen[bytes]) -> None:
    if sim.poll() is not None:
        return
    os.killpg(sim.pid, signal.SIGTERM)
    try:
        sim.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(sim.pid, signal.SIGKILL)
        sim.wait(5)


def banner(base_url: str, model: str) -> str:
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Write a haiku about GPUs"}],
    })
    return f"""
specrouter demo: router on {base_url} in front of one simulated GPU group ({GROUP}).

Try it with curl:

  curl -sN {base_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'

or with the openai Python client:

from openai import OpenAI

client = OpenAI(base_url="{base_url}/v1", api_key="none")
stream = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "Write a haiku about GPUs"}}],
    max_tokens=64,
    stream=True,
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

Response headers x-specrouter-pool and x-specrouter-backend say where each request went;
{base_url}/ready shows the backends. Press Ctrl-C to stop.
"""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


async def _serve_and_announce(settings: Settings, text: str) -> None:
    from specrouter.assembly import build_app

    server = uvicorn.Server(uvicorn_config(settings, build_app(settings)))
    # SIGHUP (the terminal closed) stops the router like SIGTERM; uvicorn handles only
    # SIGINT and SIGTERM and would otherwise die at once.
    signal.signal(signal.SIGHUP, lambda _sig, frame: server.handle_exit(signal.SIGTERM, frame))
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(text, flush=True)
    await task


def run(args: argparse.Namespace) -> int:
    if _port_in_use(args.host, args.port):
        print(f"specrouter demo: port {args.port} on {args.host} is in use; "
              f"pass --port to pick another", file=sys.stderr)
        return 2
    # After its graceful shutdown uvicorn raises the signal it caught again; SIGTERM's default
    # action would end the process before the `finally` below stops the simulator.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    eagle_port, baseline_port = _free_port("127.0.0.1"), _free_port("127.0.0.1")
    sim = start_simulator(eagle_port, baseline_port, args.profile, args.time_scale)
    try:
        model = wait_for_models(f"http://127.0.0.1:{eagle_port}", sim)
        wait_for_models(f"http://127.0.0.1:{baseline_port}", sim)
        settings = load_settings(overrides={
            "listen": {"host": args.host, "port": args.port, "log_level": "warning"},
            "backends": [
                {"name": f"{GROUP}-eagle", "url": f"http://127.0.0.1:{eagle_port}",
                 "pool": "eagle", "group": GROUP},
                {"name": f"{GROUP}-baseline", "url": f"http://127.0.0.1:{baseline_port}",
                 "pool": "baseline", "group": GROUP},
            ],
        })
        settings = fit_descriptor_budget(settings).apply(settings)
        asyncio.run(_serve_and_announce(settings, banner(f"http://{args.host}:{args.port}", model)))
    except (RuntimeError, ConfigError, DescriptorBudgetError) as exc:
        print(f"specrouter demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        stop_simulator(sim)
    print("specrouter demo: stopped")
    return 0
