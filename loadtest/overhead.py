"""Added latency of the router: time-to-first-token through it vs direct to the simulator.

    python -m loadtest.overhead [--concurrency 100] [--rounds 3] [--seconds 8]

Starts one simulated GPU group (`specrouter sim`) and `specrouter serve` in front of it,
then alternates phases (direct, router, direct, router, ...) of closed-loop streaming
chat completions at the given concurrency to the simulated EAGLE server, directly or
through a router configured with that one server (so both paths reach the same engine).
Alternating phases cancels slow drift (CPU contention from other work on the host).

Reported: p50/p90/p99 TTFT per path, their differences (the added latency), and the
router's CPU seconds per streamed request from /proc/<pid>/stat (user + system).

The client is a minimal HTTP/1.1 client on raw asyncio streams with keep-alive
connections, so that the load generator's own CPU cost (which is on the same cores)
stays small next to what is being measured.
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

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited early: {proc.args!r}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


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


def summarize(phases: list[Phase], cpu_per_request: float) -> dict[str, object]:
    direct = [t for p in phases if p.name == "direct" for t in p.ttft]
    routed = [t for p in phases if p.name == "router" for t in p.ttft]
    result: dict[str, object] = {
        "requests_direct": len(direct), "requests_router": len(routed),
        "errors": sum(p.errors for p in phases),
        "router_cpu_ms_per_request": round(cpu_per_request * 1e3, 3),
    }
    for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        d, r = pct(direct, q), pct(routed, q)
        result[f"ttft_{label}_direct_ms"] = round(d * 1e3, 3)
        result[f"ttft_{label}_router_ms"] = round(r * 1e3, 3)
        result[f"added_{label}_ms"] = round((r - d) * 1e3, 3)
    result["ttft_mean_added_ms"] = round(
        (statistics.fmean(routed) - statistics.fmean(direct)) * 1e3, 3
    )
    return result


async def bench(
    args: argparse.Namespace, eagle_port: int, router_port: int, router_pid: int
) -> None:
    body = json.dumps({
        "model": args.model, "stream": True, "max_tokens": args.max_tokens,
        "messages": [{"role": "user", "content": "Say something short."}],
    }).encode()
    # Warm both paths (connection pools, first-request costs).
    await run_phase("warm", "127.0.0.1", eagle_port, body, args.concurrency, 1.0)
    await run_phase("warm", "127.0.0.1", router_port, body, args.concurrency, 1.0)
    phases: list[Phase] = []
    cpu = 0.0
    for _ in range(args.rounds):
        phases.append(await run_phase("direct", "127.0.0.1", eagle_port, body,
                                      args.concurrency, args.seconds))
        before = _cpu_seconds(router_pid)
        routed = await run_phase("router", "127.0.0.1", router_port, body,
                                 args.concurrency, args.seconds)
        cpu += _cpu_seconds(router_pid) - before
        phases.append(routed)
        print(f"round: direct p50 {pct(phases[-2].ttft, .5) * 1e3:.2f} ms, "
              f"router p50 {pct(routed.ttft, .5) * 1e3:.2f} ms "
              f"({routed.requests} streams)", file=sys.stderr)
    routed_requests = sum(p.requests for p in phases if p.name == "router")
    print(json.dumps(summarize(phases, cpu / max(1, routed_requests)), indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="default")
    parser.add_argument("--profile", default="seed-coding")
    parser.add_argument("--time-scale", default="0.05")
    parser.add_argument("--sim-arg", action="append", default=[],
                        help="extra argument for `specrouter sim` (repeatable)")
    parser.add_argument("--target-port", type=int,
                        help="benchmark an already running server on this loopback port "
                             "(e.g. a real SGLang server) instead of starting the simulator")
    args = parser.parse_args()

    router_port = _free_port()
    py = sys.executable
    if args.target_port is not None:
        eagle_port = args.target_port
        sim = subprocess.Popen([py, "-c", "import time; time.sleep(1e9)"])
    else:
        eagle_port, baseline_port = _free_port(), _free_port()
        sim = subprocess.Popen(
            [py, "-m", "specrouter", "sim", "--group", "gpu0", "--eagle-port", str(eagle_port),
             "--baseline-port", str(baseline_port), "--profile", args.profile,
             "--time-scale", args.time_scale, "--seed", "7", *args.sim_arg],
            cwd=REPO, start_new_session=True,
        )
    backends = [{"name": "gpu0-eagle", "url": f"http://127.0.0.1:{eagle_port}",
                 "pool": "eagle", "group": "gpu0"}]
    router = subprocess.Popen(
        [py, "-m", "specrouter", "serve", "--port", str(router_port), "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "SPECROUTER_BACKENDS": json.dumps(backends)},
        start_new_session=True,
    )
    try:
        if args.target_port is None:
            _wait_http(f"http://127.0.0.1:{eagle_port}/v1/models", sim)
        _wait_http(f"http://127.0.0.1:{router_port}/health", router)
        if args.model == "default" and args.target_port is None:
            models = httpx.get(f"http://127.0.0.1:{eagle_port}/v1/models").json()
            args.model = models["data"][0]["id"]
        import uvloop

        uvloop.run(bench(args, eagle_port, router_port, router.pid))
    finally:
        for proc in (router, sim):
            proc.terminate()
        for proc in (router, sim):
            proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
