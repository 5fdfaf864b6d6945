"""Does the simulator keep up with its own clock? Starts `specrouter sim` in a subprocess,
drives N concurrent streaming chat requests at it with a minimal raw-socket client, and reports
how far the engine fell behind its deadlines.

`busy/wall` is simulated GPU-busy seconds per real second while the batch is full: 1.0 means
every step started on time (times the time scale). Run:
`python -m specrouter.sim.capacity --streams 128 --profile h200-llama3-8b --pool baseline`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _state(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/state", timeout=10) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


async def _stream(port: int, max_tokens: int, stop: asyncio.Event, chunks: list[int]) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4000}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    while not stop.is_set():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        while not stop.is_set():
            data = await reader.read(65536)
            if not data:
                break
            chunks[0] += data.count(b"data: ")
            if b"data: [DONE]" in data:
                break
        writer.close()


async def _drive(port: int, streams: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    stop = asyncio.Event()
    chunks = [0]
    tasks = [asyncio.create_task(_stream(port, max_tokens, stop, chunks)) for _ in range(streams)]
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(_state, port))["running"] < streams:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine never reached the requested batch size")
        await asyncio.sleep(0.1)
    before, t0, c0 = await asyncio.to_thread(_state, port), time.monotonic(), chunks[0]
    await asyncio.sleep(seconds)
    after, t1, c1 = await asyncio.to_thread(_state, port), time.monotonic(), chunks[0]
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = t1 - t0
    scale = after["time_scale"]
    return {
        "streams": streams, "wall_s": round(wall, 2),
        "busy_per_wall": round((after["busy_sim_s"] - before["busy_sim_s"]) * scale / wall, 3),
        "steps_per_s": round((after["decode_steps"] - before["decode_steps"]) / wall, 1),
        "tokens_per_s": round((after["generated_tokens"] - before["generated_tokens"]) / wall),
        "chunks_per_s_received": round((c1 - c0) / wall),
        "dropped_real_s": round(after["dropped_real_s"] - before["dropped_real_s"], 3),
        "max_late_real_ms": round(after["max_late_real_s"] * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--profile", default="h200-llama3-8b")
    parser.add_argument("--pool", choices=("eagle", "baseline"), default="baseline")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=100000)
    args = parser.parse_args()
    port = _free_port()
    argv = [sys.executable, "-m", "specrouter", "sim", "--single", args.pool, "--port", str(port),
            "--profile", args.profile, "--time-scale", str(args.time_scale),
            "--max-running-requests", str(max(args.streams, 1))]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        print(proc.stdout.readline().strip(), file=sys.stderr)
        cpu0 = _children_cpu()
        result = asyncio.run(_drive(port, args.streams, args.seconds, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(10)
    result["sim_cpu_s_total"] = round(_children_cpu() - cpu0, 2)
    result.update(profile=args.profile, pool=args.pool, time_scale=args.time_scale,
                  cores=os.cpu_count())
    print(json.dumps(result))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
