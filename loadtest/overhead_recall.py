"""CPU per `unless_recalled` call: without a recall event, and with the router's
`RecallEvent` (a callback on set). The waiter-task path with a plain `asyncio.Event` it
replaced measured 25-26 us per call (docs/router.md section 6).

`python -m loadtest.overhead_recall`: the work is a coroutine awaiting a future resolved
at the next loop iteration; 20,000 calls per kind, 2 rounds. An EAGLE-3 stream the router
may recall makes two calls (the upstream request, the first chunk).
"""

from __future__ import annotations

import asyncio
import time

from specrouter.proxy.recall import unless_recalled
from specrouter.routing.router import RecallEvent

KINDS = ("none", "RecallEvent")


async def _work(loop: asyncio.AbstractEventLoop) -> int:
    done: asyncio.Future[int] = loop.create_future()
    loop.call_soon(done.set_result, 1)
    return await done


async def cpu_per_call(kind: str, calls: int = 20_000) -> float:
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for _ in range(calls):
        event = None if kind == "none" else RecallEvent()
        await unless_recalled(_work(loop), event)
    return (time.process_time() - started) / calls


def main() -> None:
    for _ in range(2):
        for kind in KINDS:
            print(f"{kind}: {asyncio.run(cpu_per_call(kind)) * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
