"""Background-task lifecycle shared by the router's pollers and checkers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each to finish.

    All are cancelled before any is awaited, so shutdown takes as long as the slowest
    task rather than the sum of them; the CancelledError each one ends with is expected
    and swallowed, any other exception still propagates.
    """
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
