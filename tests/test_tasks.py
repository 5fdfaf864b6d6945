"""cancel_and_wait: every task ends, expected cancellations are quiet, real errors are not."""

from __future__ import annotations

import asyncio

import pytest

from specrouter.tasks import cancel_and_wait


async def _forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


def test_cancels_and_awaits_every_task() -> None:
    async def scenario() -> list[asyncio.Task[None]]:
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(_forever(e)) for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=30)
        await cancel_and_wait(tasks)
        return tasks

    tasks = asyncio.run(scenario())
    assert all(t.done() and t.cancelled() for t in tasks)


def test_an_error_other_than_cancellation_propagates() -> None:
    async def refuses_to_stop(started: asyncio.Event) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup failed")

    async def scenario() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(refuses_to_stop(started))
        await asyncio.wait_for(started.wait(), timeout=30)
        await cancel_and_wait([task])

    with pytest.raises(RuntimeError, match="cleanup failed"):
        asyncio.run(scenario())
