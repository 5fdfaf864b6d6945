"""CPU per telemetry poll: the poller's httpx client against its native GET client.

`python -m loadtest.overhead_poll`: one simulated group (the `overhead` scenario's
zero-prefill profile); the poller polls its EAGLE-3 engine back to back (so every 5th
poll also reads /metrics for the windowed accept length), `--polls` times per client,
the clients alternating `--rounds` times. Printed: CPU microseconds per poll (the whole
process: request, parse, publish into a LoadView).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from loadtest import loopback
from loadtest.procs import Stack
from loadtest.scenarios import overhead
from specrouter.backends import Backend
from specrouter.observe.loadview import LoadView
from specrouter.observe.telemetry import TelemetryPoller


async def cpu_per_poll(url: str, native: bool, polls: int) -> float:
    backend = Backend("e", url, "eagle", "g")
    view = LoadView()
    view.add_backend("e", "g", "eagle")
    client = None if native else loopback.async_client(timeout=2.0)
    poller = TelemetryPoller([backend], view.publish, view.publish_accept, view.poll_started,
                             client=client)
    try:
        for _ in range(20):  # warm: connections open, source found
            await poller.poll_once(backend)
        started = time.process_time()
        for _ in range(polls):
            await poller.poll_once(backend)
        return (time.process_time() - started) / polls
    finally:
        await poller.stop()
        if client is not None:
            await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--polls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    s = overhead.OverheadSettings()
    with Stack() as stack:
        sim = stack.sim_group("gpu0", str(overhead.zero_cost_profile(1.0)), s.time_scale,
                              s.seed)
        url = sim.urls()["eagle"]
        for _ in range(args.rounds):
            for native in (False, True):
                cpu = asyncio.run(cpu_per_poll(url, native, args.polls))
                print(f"{'native' if native else 'httpx'}: {cpu * 1e6:.0f} us CPU per poll")


if __name__ == "__main__":
    main()
