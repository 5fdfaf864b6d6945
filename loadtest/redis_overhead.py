"""Added request latency of Redis mode over in-memory mode, through the router.

    python -m loadtest.redis_overhead [--pairs 2000] [--peers 2] [--max-tokens 2]

Starts a `redis-server`, one simulated engine with no prefill cost (the zero-prefill copy
of seed-coding, as in the overhead scenario), and two `specrouter serve` in front of it: one
in memory mode (no Redis URL), one in Redis mode, plus `--peers` idle Redis-mode replicas so
the measured one merges a real cluster view and its background loops run as in production.
A probe sends one short streaming request at a time, alternating memory and Redis router:
each pair sees the same engine and host state, so the paired difference is what Redis mode
adds to a request (its request path only touches local memory; the Redis work runs in
background tasks, which do compete for the same cores).

Reported: p50/p90/p99 of time to first token and to the end of the stream per mode, their
differences, and the median of the paired differences.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from loadtest.overhead import Conn, chat_body, pct
from loadtest.procs import free_port, wait_http
from loadtest.scenarios.overhead import zero_cost_profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _router(port: int, backends: str, redis_url: str | None) -> subprocess.Popen[bytes]:
    env = {"SPECROUTER_BACKENDS": backends,
           # Identical admission in both modes: no arrival window, same telemetry polls.
           "SPECROUTER_ADMISSION": json.dumps({"arrival_window_ms": 0})}
    if redis_url:
        env["SPECROUTER_REDIS_URL"] = redis_url
    return _start([sys.executable, "-m", "specrouter", "serve", "--port", str(port),
                   "--log-level", "warning"], env)


def _wait_redis(port: int, proc: subprocess.Popen[bytes]) -> None:
    import redis

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("redis-server exited early")
        try:
            if redis.Redis(port=port, socket_timeout=0.5).ping():
                return
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not answer")


async def probe(memory_port: int, redis_port: int, body: bytes, pairs: int,
                warmup: int) -> dict[str, list[float]]:
    memory, clustered = Conn("127.0.0.1", memory_port), Conn("127.0.0.1", redis_port)
    out: dict[str, list[float]] = {"memory_ttft": [], "redis_ttft": [], "memory_e2e": [],
                                   "redis_e2e": []}
    try:
        for i in range(warmup + pairs):
            # Alternate which mode goes first, so neither always follows the other.
            order = ((memory, "memory"), (clustered, "redis"))
            for conn, mode in (order if i % 2 == 0 else order[::-1]):
                ttft, e2e = await conn.stream("/v1/chat/completions", body)
                if i >= warmup:
                    out[f"{mode}_ttft"].append(ttft)
                    out[f"{mode}_e2e"].append(e2e)
    finally:
        memory.close()
        clustered.close()
    return out


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    result: dict[str, float] = {"pairs": float(len(samples["memory_ttft"]))}
    for metric in ("ttft", "e2e"):
        mem, red = samples[f"memory_{metric}"], samples[f"redis_{metric}"]
        for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            m, r = pct(mem, q), pct(red, q)
            result[f"{metric}_{label}_memory_ms"] = round(m * 1e3, 3)
            result[f"{metric}_{label}_redis_ms"] = round(r * 1e3, 3)
            result[f"{metric}_{label}_added_ms"] = round((r - m) * 1e3, 3)
        paired = [r - m for m, r in zip(mem, red, strict=True)]
        result[f"{metric}_paired_added_median_ms"] = round(statistics.median(paired) * 1e3, 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000, help="probe pairs measured")
    parser.add_argument("--warmup", type=int, default=100, help="probe pairs not measured")
    parser.add_argument("--peers", type=int, default=2,
                        help="extra idle Redis-mode replicas in the cluster")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per probe")
    parser.add_argument("--time-scale", default="0.05", help="simulator time scale")
    args = parser.parse_args()

    redis_server = shutil.which("redis-server") or "/usr/bin/redis-server"
    workdir = tempfile.mkdtemp(prefix="redis-overhead-")
    redis_port, sim_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        redis = _start([redis_server, "--port", str(redis_port), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--dir", workdir])
        procs.append(redis)
        _wait_redis(redis_port, redis)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        sim = _start([sys.executable, "-m", "specrouter", "sim", "--single", "baseline",
                      "--port", str(sim_port), "--profile", str(zero_cost_profile(1.0)),
                      "--time-scale", args.time_scale, "--seed", "7"])
        procs.append(sim)
        wait_http(f"http://127.0.0.1:{sim_port}/v1/models", sim)
        backends = json.dumps([{"name": "gpu0-only", "url": f"http://127.0.0.1:{sim_port}",
                                "pool": "eagle", "group": "gpu0"}])
        memory_port, redis_mode_port = free_port(), free_port()
        routers = [(memory_port, None), (redis_mode_port, redis_url)]
        routers += [(free_port(), redis_url) for _ in range(args.peers)]
        for port, url in routers:
            proc = _router(port, backends, url)
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{port}/health", proc)
        body = chat_body("default", args.max_tokens)
        import uvloop

        samples = uvloop.run(probe(memory_port, redis_mode_port, body, args.pairs,
                                   args.warmup))
        result = summarize(samples)
        result["peers"] = float(args.peers)
        print(json.dumps(result, indent=2))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
