"""Added latency of the router: time-to-first-token through it vs direct to the simulator.

    python -m loadtest.overhead [--concurrency 100] [--seconds 30] [--time-scale 0.5]

Starts one simulated engine (`specrouter sim --single baseline`) and `specrouter serve` in
front of it. `--concurrency` closed-loop streams run through the router the whole time
(the router relays every one of their tokens, as it would in production), and a probe
sends one short request at a time, alternating direct and through the router. Each pair
of probes sees the same engine batch and the same host load, so the difference between
the two TTFT distributions is what the router adds at that concurrency; comparing two
separate runs instead mostly measures drift in whatever else the host runs.

Reported: p50/p90/p99 probe TTFT per path and their differences, the median of paired
differences, and the router's CPU seconds per streamed request and per token, from
/proc/<pid>/stat (user + system).

The client is a minimal HTTP/1.1 client on raw asyncio streams with keep-alive
connections, so the load generator's own CPU cost (on the same cores) stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from loadtest import loopback
from loadtest.procs import free_port, wait_http

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class Conn:
    """One keep-alive HTTP/1.1 connection that sends a POST and reads a chunked SSE body."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, path: str, body: bytes) -> tuple[float, float]:
        """(seconds to the first body chunk, seconds to the end of the body)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        request = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        start = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
        first: float | None = None
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            if first is None and b"data:" in data:
                first = time.perf_counter() - start
        end = time.perf_counter() - start
        return (first if first is not None else end), end

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class Phase:
    name: str
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0


async def run_phase(
    name: str, host: str, port: int, body: bytes, concurrency: int, seconds: float
) -> Phase:
    phase = Phase(name)
    deadline = time.perf_counter() + seconds

    async def user() -> None:
        conn = Conn(host, port)
        try:
            while time.perf_counter() < deadline:
                try:
                    ttft, _ = await conn.stream("/v1/chat/completions", body)
                    phase.ttft.append(ttft)
                    phase.requests += 1
                except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError):
                    phase.errors += 1
                    conn.close()
                    conn = Conn(host, port)
        finally:
            conn.close()

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return phase


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chat_body(model: str, max_tokens: int) -> bytes:
    return json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Say something short."}],
    }).encode()


async def probe(
    router_port: int, direct_port: int, body: bytes, stop: asyncio.Event
) -> tuple[list[float], list[float]]:
    """One request at a time, alternating direct and routed: both samples see the same
    engine batch and the same host load, so their difference is the router's doing."""
    direct, routed = Conn("127.0.0.1", direct_port), Conn("127.0.0.1", router_port)
    ttft_direct: list[float] = []
    ttft_routed: list[float] = []
    try:
        while not stop.is_set():
            ttft_direct.append((await direct.stream("/v1/chat/completions", body))[0])
            ttft_routed.append((await routed.stream("/v1/chat/completions", body))[0])
    finally:
        direct.close()
        routed.close()
    return ttft_direct, ttft_routed


async def bench(
    args: argparse.Namespace, direct_port: int, router_port: int, router_pid: int
) -> dict[str, object]:
    background = chat_body(args.model, args.bg_max_tokens)
    # Warm the router's connection pool up to the background concurrency.
    await run_phase("warm", "127.0.0.1", router_port, background, args.concurrency, 1.0)
    stop = asyncio.Event()
    cpu_before = _cpu_seconds(router_pid)
    load = asyncio.ensure_future(run_phase("background", "127.0.0.1", router_port, background,
                                           args.concurrency, args.seconds))
    await asyncio.sleep(min(2.0, args.seconds / 4))  # let the batch fill up
    probes = asyncio.ensure_future(
        probe(router_port, direct_port, chat_body(args.model, args.max_tokens), stop))
    bg = await load
    stop.set()
    ttft_direct, ttft_routed = await probes
    cpu = _cpu_seconds(router_pid) - cpu_before
    routed_requests = bg.requests + len(ttft_routed)
    result: dict[str, object] = {
        "concurrency_through_router": args.concurrency + 1,
        "background_streams": bg.requests, "background_errors": bg.errors,
        "probes_per_path": min(len(ttft_direct), len(ttft_routed)),
        "router_cpu_s": round(cpu, 3),
        "router_cpu_ms_per_request": round(cpu / max(1, routed_requests) * 1e3, 3),
        "router_cpu_us_per_token": round(
            cpu / max(1, bg.requests * args.bg_max_tokens) * 1e6, 1),
    }
    for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        d, r = pct(ttft_direct, q), pct(ttft_routed, q)
        result[f"ttft_{label}_direct_ms"] = round(d * 1e3, 3)
        result[f"ttft_{label}_router_ms"] = round(r * 1e3, 3)
        result[f"added_{label}_ms"] = round((r - d) * 1e3, 3)
    paired = [r - d for d, r in zip(ttft_direct, ttft_routed, strict=False)]
    result["paired_added_median_ms"] = round(statistics.median(paired) * 1e3, 3)
    result["mean_added_ms"] = round(
        (statistics.fmean(ttft_routed) - statistics.fmean(ttft_direct)) * 1e3, 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", dest="concurrency", type=int, default=100,
                        help="background streams through the router")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the run")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per probe request")
    parser.add_argument("--bg-max-tokens", type=int, default=64,
                        help="tokens per background stream")
    parser.add_argument("--model", default="default")
    parser.add_argument("--profile", default="seed-coding")
    parser.add_argument("--time-scale", default="0.5",
                        help="simulator time scale; small values make the simulator CPU-bound")
    parser.add_argument("--pool", choices=["eagle", "baseline"], default="baseline",
                        help="engine kind to simulate (baseline: 256 running slots, so 100 "
                             "streams run without queueing)")
    parser.add_argument("--sim-arg", action="append", default=[],
                        help="extra argument for `specrouter sim` (repeatable)")
    parser.add_argument("--target-port", type=int,
                        help="benchmark an already running server on this loopback port "
                             "(e.g. a real SGLang server) instead of starting the simulator")
    args = parser.parse_args()

    router_port = free_port()
    py = sys.executable
    if args.target_port is not None:
        eagle_port = args.target_port
        sim = subprocess.Popen([py, "-c", "import time; time.sleep(1e9)"])
    else:
        eagle_port = free_port()
        sim = subprocess.Popen(
            [py, "-m", "specrouter", "sim", "--group", "gpu0", "--single", args.pool,
             "--port", str(eagle_port), "--profile", args.profile,
             "--time-scale", args.time_scale, "--seed", "7", *args.sim_arg],
            cwd=REPO, start_new_session=True,
        )
    backends = [{"name": f"gpu0-{args.pool}", "url": f"http://127.0.0.1:{eagle_port}",
                 "pool": args.pool, "group": "gpu0"}]
    router = subprocess.Popen(
        [py, "-m", "specrouter", "serve", "--port", str(router_port), "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "SPECROUTER_BACKENDS": json.dumps(backends)},
        start_new_session=True,
    )
    try:
        if args.target_port is None:
            wait_http(f"http://127.0.0.1:{eagle_port}/v1/models", sim)
        wait_http(f"http://127.0.0.1:{router_port}/health", router)
        if args.model == "default" and args.target_port is None:
            models = loopback.get(f"http://127.0.0.1:{eagle_port}/v1/models").json()
            args.model = models["data"][0]["id"]
        import uvloop

        print(json.dumps(uvloop.run(bench(args, eagle_port, router_port, router.pid)), indent=2))
    finally:
        for proc in (router, sim):
            proc.terminate()
        for proc in (router, sim):
            proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
