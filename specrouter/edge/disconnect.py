"""The client's disconnect watch (`specrouter.proxy.response.DISCONNECT_WATCH`) on uvicorn's
httptools protocol: a callback the protocol calls, from its `connection_lost`, when the
client leaves before the response completed.

It tells the app what a task blocked in `receive()` until `http.disconnect` would tell it,
for one callback instead of a task per request: `receive` returns `http.disconnect` when
the cycle is marked disconnected, which is exactly when `lost` calls back. Arming it
resumes reading from the client as `receive` does (uvicorn pauses reading past 64 KiB of
unread body): a connection that is not read never reports its end.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


def mark_disconnected(cycle: RequestResponseCycle) -> None:
    """What uvicorn's `connection_lost` does to its current cycle, for any cycle of the
    lost connection whose response was cut: its `send` writes nothing more and its
    `receive` returns `http.disconnect`. uvicorn marks only the last request it parsed,
    which under pipelining is not the one still responding."""
    if not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()


class CycleDisconnectWatch:
    """The watch for one request/response cycle of one client connection. It lives in
    the cycle's scope and holds the cycle weakly, so that a request's cycle and scope are
    no reference cycle and die by reference count; a watch whose cycle is gone is quiet."""

    __slots__ = ("_callback", "_cycle")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)
        self._callback: Callable[[], None] | None = None

    def __call__(self, callback: Callable[[], None] | None) -> None:
        """Arm `callback` (None disarms). A client already gone is reported on the next
        turn of the loop, never from inside the caller."""
        self._callback = callback
        cycle = self._cycle()
        if callback is None or cycle is None or cycle.response_complete:
            return
        if cycle.disconnected:
            asyncio.get_running_loop().call_soon(self.lost)
        else:
            cycle.flow.resume_reading()

    @property
    def open(self) -> bool:
        """Whether the cycle is alive and its response not complete."""
        cycle = self._cycle()
        return cycle is not None and not cycle.response_complete

    def connection_lost(self) -> None:
        """The connection is gone: the cycle is marked (`mark_disconnected`), then `lost`."""
        cycle = self._cycle()
        if cycle is not None:
            mark_disconnected(cycle)
        self.lost()

    def lost(self) -> None:
        """The connection is gone: call back once if the cycle's response was cut."""
        callback, cycle = self._callback, self._cycle()
        if callback is not None and cycle is not None and cycle.disconnected:
            self._callback = None
            callback()
