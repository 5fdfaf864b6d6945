"""Per-request cost of the state layer: acquire + cluster_inflight + release, memory vs Redis.

Run: .venv/bin/python -m loadtest.state_overhead [--requests 20000] [--replicas 3]
Starts its own redis-server (no persistence) on a free port; in Redis mode `--replicas`
stores run in this process so the view really merges several replicas' counts and the
background publish/refresh loops compete with the measured calls for the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from pydantic import SecretStr

from specrouter.state import StateSettings, StateStore, make_store

BACKENDS = [f"gpu{g}/{kind}" for g in range(4) for kind in ("eagle", "base")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _measure(store: StateStore, requests: int) -> list[float]:
    """Microseconds per request; yields to the loop every 32 requests like a busy server."""
    samples: list[float] = []
    for i in range(requests):
        backend = BACKENDS[i % len(BACKENDS)]
        t0 = time.perf_counter_ns()
        view = store.cluster_inflight()
        _ = view.get(backend, 0)
        lease = store.acquire(backend)
        lease.release()
        samples.append((time.perf_counter_ns() - t0) / 1000)
        if i % 32 == 0:
            await asyncio.sleep(0)
    return samples


def _summary(name: str, samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    mean = statistics.fmean(samples)
    return f"{name:<7} p50 {q[49]:6.2f} us   p99 {q[98]:6.2f} us   mean {mean:6.2f} us"


async def _run(requests: int, replicas: int) -> None:
    memory = make_store(StateSettings(), "bench")
    await memory.start()
    mem = await _measure(memory, requests)
    await memory.close()

    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="redis-bench-")
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    try:
        settings = StateSettings(redis_url=SecretStr(f"redis://127.0.0.1:{port}/0"))
        stores = [make_store(settings, f"bench{i}") for i in range(replicas)]
        deadline = time.monotonic() + 10
        for store in stores:
            while True:
                await store.start()
                if store.status()["connected"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
        for i, other in enumerate(stores[1:]):  # the others hold some load
            for _ in range(i + 1):
                other.acquire(BACKENDS[0])
        await asyncio.sleep(0.2)
        red = await _measure(stores[0], requests)
        assert stores[0].status()["connected"], stores[0].status()
        for store in stores:
            await store.close()
    finally:
        server.kill()
        server.wait()
    print(f"{requests} requests, {len(BACKENDS)} backends, {replicas} replicas in redis mode")
    print(_summary("memory", mem))
    print(_summary("redis", red))
    q_mem = statistics.quantiles(mem, n=100)
    q_red = statistics.quantiles(red, n=100)
    added_p50, added_p99 = q_red[49] - q_mem[49], q_red[98] - q_mem[98]
    print(f"added by redis mode: p50 {added_p50:+.2f} us, p99 {added_p99:+.2f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args(argv)
    asyncio.run(_run(args.requests, args.replicas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
