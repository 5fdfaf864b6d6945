"""Whether a request's whole body is in (`specrouter.proxy.request.BODY_COMPLETE`), on
uvicorn's httptools protocol.

httptools parses everything one read from the socket holds before the app's task runs: a
request whose head and body came together is complete by the time the app looks, and
`receive()` then returns the body without waiting. The proxy bounds its body read by a
timer only where it could wait (a body still arriving), which saves the timer on nearly
every request.
"""

from __future__ import annotations

import weakref

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class CycleBodyComplete:
    """The check for one request/response cycle. It lives in the cycle's scope and holds
    the cycle weakly (as `edge.writer` explains); a check whose cycle is gone says no."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def __call__(self) -> bool:
        cycle = self._cycle()
        return (cycle is not None and not cycle.more_body and not cycle.disconnected
                and not cycle.response_complete)
