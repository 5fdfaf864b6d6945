"""Quick router-vs-static check on one simulated GPU group (a developer tool, not the bench).

    .venv/bin/python scripts/router_sweep.py PROFILE TIME_SCALE LEVELS ROUNDS [POLICY_JSON]
    e.g. scripts/router_sweep.py seed-coding 0.1 1,2,4,8,16,32,64 3

Starts `specrouter sim` (one group), sweeps eagle-only and baseline-only directly with
`specrouter.commands.calibrate.client` (closed loop, max(ROUNDS*C, 8) requests per level,
1000 in / 256 out, ignore_eos), derives the threshold policy like `specrouter calibrate`, starts
`specrouter serve` with it and sweeps the router; prints the ratios to the better static pool
(targets: throughput >= 0.97x, median latency <= 1.05x). The full benchmark is `make bench`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from specrouter.commands.calibrate.client import LoadShape, PoolClient, run_level
from specrouter.commands.calibrate.derive import recommend
from specrouter.commands.calibrate.measure import LevelResult

PY = sys.executable


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


async def _levels(urls: dict[str, str], levels: list[int], shape: LoadShape,
                  rounds: int) -> dict[str, list[LevelResult]]:
    out: dict[str, list[LevelResult]] = {}
    limits = httpx.Limits(max_connections=max(levels) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600, trust_env=False) as client:
        for name, url in urls.items():
            pool_client = PoolClient(url, shape, None, client)
            await pool_client.one(LevelResult(name, 1))  # warm-up
            out[name] = []
            for c in levels:
                r = await run_level(pool_client, name, c, None, max(rounds * c, 8))
                out[name].append(r)
                print(f"{name:8s} c={c:<3d} {r.throughput_tok_s:9.1f} tok/s  "
                      f"p50 {r.median_latency_s or 0:.3f} s  errors {r.errors}"
                      f"{_eagle_decisions(url) if name == 'router' else ''}", flush=True)
    return out


def _eagle_decisions(router_url: str) -> str:
    """Running total of the router's EAGLE-3 decisions (to see which level got them)."""
    text = httpx.get(router_url + "/metrics", timeout=5).text
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith('specrouter_decisions_total{pool="eagle"'))
    return f"  eagle decisions so far {total:.0f}"


def main(profile: str, time_scale: float, levels: list[int], rounds: int,
         extra_policy: dict[str, Any]) -> int:
    ep, bp, rp = _port(), _port(), _port()
    sim = subprocess.Popen([PY, "-m", "specrouter", "sim", "--eagle-port", str(ep),
                            "--baseline-port", str(bp), "--profile", profile,
                            "--time-scale", str(time_scale)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = None
    misses = 0
    try:
        e, b = f"http://127.0.0.1:{ep}", f"http://127.0.0.1:{bp}"
        _wait(e + "/v1/models")
        _wait(b + "/v1/models")
        model = httpx.get(e + "/v1/models").json()["data"][0]["id"]
        shape = LoadShape(1000, 256, model)
        static = asyncio.run(_levels({"eagle": e, "baseline": b}, levels, shape, rounds))
        rec = recommend(static, "threshold")
        policy = {**rec.patch, **extra_policy}
        print(f"crossover {rec.crossover} -> policy {policy}", flush=True)
        backends = [{"name": "gpu0-eagle", "url": e, "pool": "eagle", "group": "gpu0"},
                    {"name": "gpu0-baseline", "url": b, "pool": "baseline", "group": "gpu0"}]
        env = {**os.environ, "SPECROUTER_BACKENDS": json.dumps(backends),
               "SPECROUTER_POLICY": json.dumps(policy)}
        router = subprocess.Popen([PY, "-m", "specrouter", "serve", "--port", str(rp),
                                   "--log-level", "warning"], env=env)
        r = f"http://127.0.0.1:{rp}"
        _wait(r + "/health")
        routed = asyncio.run(_levels({"router": r}, levels, shape, rounds))
        decisions = [line for line in httpx.get(r + "/metrics").text.splitlines()
                     if line.startswith("specrouter_decisions_total")]
        print("\n".join(decisions))
        print(f"\n{profile} time_scale={time_scale} policy={policy}")
        print("conc    eagle  baseline    router  tput_ratio  p50_ratio")
        for i, c in enumerate(levels):
            E, B, R = static["eagle"][i], static["baseline"][i], routed["router"][i]
            best_t = max(E.throughput_tok_s, B.throughput_tok_s)
            best_l = min(E.median_latency_s or 0, B.median_latency_s or 0)
            tr, lr = R.throughput_tok_s / best_t, (R.median_latency_s or 0) / best_l
            ok = tr >= 0.97 and lr <= 1.05
            misses += not ok
            print(f"{c:4d} {E.throughput_tok_s:8.1f} {B.throughput_tok_s:9.1f} "
                  f"{R.throughput_tok_s:9.1f}  {tr:10.3f}  {lr:9.3f}  {'ok' if ok else 'MISS'}",
                  flush=True)
    finally:
        if router is not None:
            router.terminate()
            router.wait()
        sim.terminate()
        sim.wait()
    return 1 if misses else 0


if __name__ == "__main__":
    if len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], float(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")],
                  int(sys.argv[4]), json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}))
