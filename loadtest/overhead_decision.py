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
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from specrouter.assembly import build_product
from specrouter.config import AffinitySettings, Settings
from specrouter.observe.loadview import EngineSample
from specrouter.routing.affinity.keys import prefix_keys
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.router import RequestInfo

GROUP = [{"name": "g0-eagle", "url": "http://127.0.0.1:1", "pool": "eagle", "group": "g0"},
         {"name": "g0-baseline", "url": "http://127.0.0.1:2", "pool": "baseline",
          "group": "g0"}]
# seed-coding's EAGLE-3 steps at batch 1, 2, 3 (ms, accept length 2.0); the baseline's
# are 1.8x cheaper at the same batch
EAGLE_STEPS = ((1, 37.4), (2, 46.1), (3, 50.4))
BASELINE_RATIO = 1.8
PROMPT_BYTES = 5000


def taught_router(window_ms: float) -> LoadAwareRouter:
    """The router `build_product` assembles for `serve` (never started: no health checks,
    polls or probes run), taught the windows by hand."""
    settings = Settings.model_validate({"backends": GROUP,
                                        "admission": {"arrival_window_ms": window_ms}})
    router = build_product(settings).router
    assert isinstance(router, LoadAwareRouter)
    monitor = router.monitor
    now = monitor.clock()
    monitor.view.publish_accept("g0-eagle", EngineSample(1, 0, now, accept_length=2.0,
                                                         accept_window=(2.0,)))
    for i, (batch, ms) in enumerate(EAGLE_STEPS * 4):
        at = now + 0.01 * i  # a new window each time (a new throughput figure)
        monitor._publish_sample("g0-eagle", EngineSample(
            batch, 0, at, max_running=48, gen_throughput=1000 * batch * 2.0 / ms + 1e-3 * i))
        monitor._publish_sample("g0-baseline", EngineSample(
            batch, 0, at, max_running=256,
            gen_throughput=1000 * batch * BASELINE_RATIO / ms + 1e-3 * i))
    return router


def request() -> RequestInfo:
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"' + (
        b"x" * PROMPT_BYTES) + b'"}]}'
    affinity = AffinitySettings()
    return RequestInfo("/v1/chat/completions", stream=True,
                       prefix=prefix_keys(body, affinity.block_bytes, affinity.bytes_per_token))


async def cpu_per_request(router: LoadAwareRouter, requests: int = 2000) -> tuple[float, str]:
    info = request()
    reason = ""
    started = time.process_time()
    for _ in range(requests):
        ahead = await router.settle(info)
        target = router.choose(replace(info, burst_ahead=ahead) if ahead else info)
        router.acquire(target)
        router.release(target)
        reason = target.reason
    return (time.process_time() - started) / requests, reason


def main() -> None:
    for _ in range(2):
        for label, window_ms in (("arrival window 2 ms", 2.0), ("no arrival window", 0.0)):
            seconds, reason = asyncio.run(cpu_per_request(taught_router(window_ms)))
            print(f"{label}: {seconds * 1e6:.0f} us CPU per request ({reason})")


if __name__ == "__main__":
    main()
