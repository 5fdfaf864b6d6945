"""Recall: an attempt the router takes back before its first byte (`Target.recall`).

Until the first non-empty chunk, setting the recall event cancels the attempt's upstream
work and raises `Recalled`: the proxy closes the upstream request, aborts it by its rid
(`specrouter.proxy.abort`) and routes the request again. After the first byte a recall
has no effect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from specrouter.routing.recall import RecallEvent

_T = TypeVar("_T")


class Recalled(Exception):
    """The router recalled this attempt before its first byte: route the request again."""


async def unless_recalled(work: Awaitable[_T], recall: asyncio.Event | None) -> _T:
    """`await work`, unless `recall` is set first: then `work` is cancelled and Recalled
    is raised. A result that is ready when the recall comes wins, and so does one that
    `work` returned while being cancelled: it is the caller's to close (a response then
    meets the recall at its first chunk). Cancelling the caller cancels `work` and
    raises CancelledError, recalled or not."""
    if recall is None:
        return await work
    if isinstance(recall, RecallEvent):
        return await _unless_recall_event(work, recall)
    return await _unless_event(work, recall)


async def _unless_recall_event(work: Awaitable[_T], recall: RecallEvent) -> _T:
    me = asyncio.current_task()
    cancels = me.cancelling() if me is not None else 0
    task = asyncio.ensure_future(work)
    if recall.is_set():
        task.cancel()
    else:
        recall.on_set(task.cancel)
    try:
        result = await task  # cancelling the caller cancels `task` with it
    except asyncio.CancelledError:
        if recall.is_set() and (me is None or me.cancelling() == cancels):
            raise Recalled from None
        raise
    except Exception:
        if recall.is_set():
            raise Recalled from None
        raise
    finally:
        recall.discard(task.cancel)
        if not task.done():  # the caller was cancelled while `task` still runs
            task.cancel()
    if me is not None and me.cancelling() > cancels:
        raise asyncio.CancelledError  # the caller was cancelled and `work` swallowed it
    return result


async def _unless_event(work: Awaitable[_T], recall: asyncio.Event) -> _T:
    task = asyncio.ensure_future(work)
    recalled = asyncio.ensure_future(recall.wait())
    try:
        await asyncio.wait((task, recalled), return_when=asyncio.FIRST_COMPLETED)
    finally:
        recalled.cancel()
        if not task.done():  # recalled, or this request was cancelled (client gone)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled() or (recall.is_set() and task.exception() is not None):
        raise Recalled
    return task.result()
