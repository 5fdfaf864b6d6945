"""`unless_recalled` with the router's recall event: the attempt's work or its recall."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from specrouter.proxy.recall import Recalled, unless_recalled
from specrouter.routing.router import RecallEvent


def test_a_recall_cancels_the_work_with_one_task() -> None:
    async def scenario() -> None:
        recall, started, cancelled = RecallEvent(), asyncio.Event(), asyncio.Event()

        async def work() -> int:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return 1

        caller = asyncio.create_task(unless_recalled(work(), recall))
        await started.wait()
        assert len(asyncio.all_tasks()) == 3  # this test, the caller, the work
        recall.set()
        with pytest.raises(Recalled):
            await caller
        assert cancelled.is_set()

    asyncio.run(scenario())


def test_already_recalled_work_never_runs() -> None:
    async def scenario() -> None:
        recall, ran = RecallEvent(), []
        recall.set()

        async def work() -> int:
            ran.append(1)
            return 1

        with pytest.raises(Recalled):
            await unless_recalled(work(), recall)
        assert not ran

    asyncio.run(scenario())


def test_a_result_ready_first_wins_and_a_later_recall_is_moot() -> None:
    async def scenario() -> None:
        recall = RecallEvent()

        async def work() -> int:
            return 7

        assert await unless_recalled(work(), recall) == 7
        recall.set()  # no callback left behind to cancel anything

    asyncio.run(scenario())


async def _recalled_while_running(on_cancel: Callable[[], Any]) -> Any:
    """Run work under `unless_recalled`, recall it once it runs, and return what the
    caller gets; the work answers its cancellation with `on_cancel()`."""
    recall, started = RecallEvent(), asyncio.Event()

    async def work() -> Any:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return on_cancel()
        return "never"

    caller = asyncio.create_task(unless_recalled(work(), recall))
    await started.wait()
    recall.set()
    return await caller


def test_a_result_returned_while_being_cancelled_wins() -> None:
    assert asyncio.run(_recalled_while_running(lambda: "response")) == "response"


def test_an_error_after_the_recall_is_a_recall() -> None:
    def closed() -> None:
        raise ConnectionError("closed")

    with pytest.raises(Recalled):
        asyncio.run(_recalled_while_running(closed))


def test_cancelling_the_caller_cancels_the_work_not_a_recall() -> None:
    async def scenario() -> None:
        recall, started, cancelled = RecallEvent(), asyncio.Event(), asyncio.Event()

        async def work() -> int:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                recall.set()  # a recall arriving meanwhile does not turn it into one
                raise
            return 1

        caller = asyncio.create_task(unless_recalled(work(), recall))
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert cancelled.is_set()

    asyncio.run(scenario())
