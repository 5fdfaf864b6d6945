"""Recall: an attempt the router takes back before its first byte (`Target.recall`).

Until the first non-empty chunk, setting the recall event cancels the attempt's upstream
work and raises `Recalled`: the proxy closes the upstream request, aborts it by its rid
(`specrouter.proxy.abort`) and routes the request again. After the first byte a recall
has no effect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from specrouter.routing.router import RecallEvent

_T = TypeVar("_T")


class Recalled(Exception):
    """The router recalled this attempt before its first byte: route the request again."""


async def unless_recalled(work: Awaitable[_T], recall: RecallEvent | None) -> _T:
    """`await work`, unless `recall` is set first: then `work` is cancelled and Recalled
    is raised. A result that is ready when the recall comes wins, and so does one that
    `work` returned while being cancelled: it is the caller's to close (a response then
    meets the recall at its first chunk). Cancelling the caller cancels `work` and
    raises CancelledError, recalled or not."""
    if recall is None:
        return await work
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
