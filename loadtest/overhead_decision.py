"""CPU per routing decision of a two-pool group under the default policy (docs/router.md
section 6, "The online decision's search").

`python -m loadtest.overhead_decision`: the router `specrouter serve` assembles
(`build_product`), in-process and never started (default policy: the online strategy;
default admission and affinity), one group of an EAGLE-3 and a baseline server, its
model taught by twelve telemetry windows per pool with seed-coding's steps (crossover
about 2 requests). Sequential streamed chat requests (a 5 KB prompt): `settle`,
`choose`, `acquire`, `release` each, CPU time (`time.process_time`) per request, 2,000
requests per round, 2 rounds, with the arrival window at its default and with it off.
On the EAGLE-3 path with the window a request takes three decisions (two dry runs in
`settle`, one in `choose`), without it one. The `peer` and `overhead` scenarios route
to one server and take none of this path.

`--groups 1,4,16,64` measures the same with that many groups (two servers each), every
server's telemetry read anew every 50 requests as polls would bring it, the window off:
how a decision's cost grows with the cluster a router fronts. `--held N` first sends N
requests to the group and keeps them, so that the measured ones meet a loaded group
(past the crossover: the baseline regime, where the window's dry run lets every
request through); the group's sustained load then follows within half a second
(`telemetry.sustained_s` 0.05 s instead of 5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from typing import Any

from specrouter.assembly import build_product
from specrouter.config import AffinitySettings, Settings
from specrouter.observe.loadview import EngineSample
from specrouter.routing.affinity.keys import prefix_keys
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.router import RequestInfo

# seed-coding's EAGLE-3 steps at batch 1, 2, 3 (ms, accept length 2.0); the baseline's
# are 1.8x cheaper at the same batch
EAGLE_STEPS = ((1, 37.4), (2, 46.1), (3, 50.4))
BASELINE_RATIO = 1.8
PROMPT_BYTES = 5000
# with `--held`: the sustained load's time constant, and the wait for it to follow
HELD_SUSTAINED_S, HELD_SETTLE_S = 0.05, 0.5


def servers(groups: int) -> list[dict[str, str]]:
    """`groups` groups of an EAGLE-3 and a baseline server (never reached)."""
    return [{"name": f"g{g}-{pool}", "url": f"http://127.0.0.1:{2 * g + k + 1}", "pool": pool,
             "group": f"g{g}"}
            for g in range(groups) for k, pool in enumerate(("eagle", "baseline"))]


def taught_router(window_ms: float, groups: int = 1,
                  sustained_s: float | None = None) -> LoadAwareRouter:
    """The router `build_product` assembles for `serve` (never started: no health checks,
    polls or probes run), taught the windows by hand."""
    raw: dict[str, Any] = {"backends": servers(groups),
                           "admission": {"arrival_window_ms": window_ms}}
    if sustained_s is not None:
        raw["telemetry"] = {"sustained_s": sustained_s}
    settings = Settings.model_validate(raw)
    router = build_product(settings).router
    assert isinstance(router, LoadAwareRouter)
    monitor = router.monitor
    now = monitor.clock()
    for g in range(groups):
        monitor.view.publish_accept(f"g{g}-eagle", EngineSample(
            1, 0, now, accept_length=2.0, accept_window=(2.0,)))
        for i, (batch, ms) in enumerate(EAGLE_STEPS * 4):
            at = now + 0.01 * i  # a new window each time (a new throughput figure)
            monitor._publish_sample(f"g{g}-eagle", EngineSample(
                batch, 0, at, max_running=48,
                gen_throughput=1000 * batch * 2.0 / ms + 1e-3 * i))
            monitor._publish_sample(f"g{g}-baseline", EngineSample(
                batch, 0, at, max_running=256,
                gen_throughput=1000 * batch * BASELINE_RATIO / ms + 1e-3 * i))
    return router


def request() -> RequestInfo:
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"' + (
        b"x" * PROMPT_BYTES) + b'"}]}'
    affinity = AffinitySettings()
    return RequestInfo("/v1/chat/completions", stream=True,
                       prefix=prefix_keys(body, affinity.block_bytes, affinity.bytes_per_token))


async def cpu_per_request(router: LoadAwareRouter, requests: int = 2000,
                          readings_every: int = 0, held: int = 0) -> tuple[float, str]:
    """CPU seconds per request, and the last request's reason. With `readings_every`,
    every server publishes a fresh reading before each such run of requests; `held`
    requests are sent first and kept."""
    info = request()
    reason = ""
    monitor = router.monitor
    for _ in range(held):
        router.acquire(router.choose(info))
    if held:
        await asyncio.sleep(HELD_SETTLE_S)
    names = tuple(monitor.view.backends)
    started = time.process_time()
    for k in range(requests):
        if readings_every and k % readings_every == 0:
            now = monitor.clock()
            for name in names:
                monitor._publish_sample(name, EngineSample(1, 0, now, max_running=48))
        ahead = await router.settle(info)
        target = router.choose(replace(info, burst_ahead=ahead) if ahead else info)
        router.acquire(target)
        router.release(target)
        reason = target.reason
    return (time.process_time() - started) / requests, reason


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.overhead_decision")
    parser.add_argument("--groups", default="", metavar="N,N,...",
                        help="group counts to measure, the arrival window off")
    parser.add_argument("--held", type=int, default=0, metavar="N",
                        help="requests kept on the group before the measured ones")
    args = parser.parse_args()
    counts = [int(n) for n in args.groups.split(",") if n]
    sustained = HELD_SUSTAINED_S if args.held else None
    for _ in range(2):
        if counts:
            for groups in counts:
                seconds, reason = asyncio.run(cpu_per_request(
                    taught_router(0.0, groups, sustained), readings_every=50,
                    held=args.held))
                print(f"{groups} groups: {seconds * 1e6:.0f} us CPU per request ({reason})")
            continue
        for label, window_ms in (("arrival window 2 ms", 2.0), ("no arrival window", 0.0)):
            seconds, reason = asyncio.run(cpu_per_request(
                taught_router(window_ms, sustained_s=sustained), held=args.held))
            print(f"{label}: {seconds * 1e6:.0f} us CPU per request ({reason})")


if __name__ == "__main__":
    main()
