"""Does the simulator keep up with its own clock? Starts `specrouter sim` in a subprocess,
drives N concurrent streaming chat requests at it with a minimal raw-socket client, and reports
how far the engine fell behind its deadlines.

`busy/wall` is simulated GPU-busy seconds per real second while the batch is full: 1.0 means
every step started on time (times the time scale). `sim_cpu_ms_per_request` is the simulator
process's CPU time over the window per finished request (short answers, `--max-tokens 16`,
make it the per-request cost: parsing, prefix keys, cache, HTTP). Run:
`python -m specrouter.sim.capacity --streams 128 --profile h200-llama3-8b --pool baseline`
`python -m specrouter.sim.capacity --streams 32 --max-tokens 16 --prompt-chars 120000`
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


def _proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a live process (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(port: int, max_tokens: int, stop: asyncio.Event, chunks: list[int],
                  prompt_chars: int, index: int) -> None:
    # each stream its own conversation, resent whole: after the first, every request finds
    # its prefix cached, as a session's turns do
    content = f"stream {index} " + "x" * max(0, prompt_chars - 12)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
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


async def _drive(port: int, pid: int, streams: int, seconds: float, max_tokens: int,
                 prompt_chars: int) -> dict[str, Any]:
    stop = asyncio.Event()
    chunks = [0]
    tasks = [asyncio.create_task(_stream(port, max_tokens, stop, chunks, prompt_chars, i))
             for i in range(streams)]
    deadline = time.monotonic() + 60
    while True:
        state = await asyncio.to_thread(_state, port)
        if state["running"] >= streams or state["finished"] >= 2 * streams:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the engine never reached the requested batch size")
        await asyncio.sleep(0.1)
    before, t0, c0 = await asyncio.to_thread(_state, port), time.monotonic(), chunks[0]
    cpu0 = _proc_cpu_s(pid)
    await asyncio.sleep(seconds)
    after, t1, c1 = await asyncio.to_thread(_state, port), time.monotonic(), chunks[0]
    cpu1 = _proc_cpu_s(pid)
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
        "requests_per_s": round((after["finished"] - before["finished"]) / wall, 1),
        "sim_cpu_ms_per_request": round(
            (cpu1 - cpu0) * 1000 / max(1, after["finished"] - before["finished"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--profile", default="h200-llama3-8b")
    parser.add_argument("--pool", choices=("eagle", "baseline", "adaptive"), default="baseline")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=100000)
    parser.add_argument("--prompt-chars", type=int, default=4000,
                        help="characters of each stream's prompt (4 per token)")
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
        result = asyncio.run(_drive(port, proc.pid, args.streams, args.seconds,
                                    args.max_tokens, args.prompt_chars))
    finally:
        proc.terminate()
        proc.wait(10)
    result["sim_cpu_s_total"] = round(_children_cpu() - cpu0, 2)
    result.update(profile=args.profile, pool=args.pool, time_scale=args.time_scale,
                  prompt_chars=args.prompt_chars, cores=os.cpu_count())
    print(json.dumps(result))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
