"""The client's chunk writer (`specrouter.proxy.response.CHUNK_WRITER`) on uvicorn's
httptools protocol: one chunk of a started chunked response, written to the client's
transport in the bytes uvicorn's own `send` would write.

It refuses (returns False) in every case where `send` would do anything else: the
response has not started or is complete, it is not chunked (a sized body or a HEAD
answer), the client left or its connection is closing, or the client's buffer is over
the high-water mark (`send` would wait for it to drain). Refused bytes stay with the
caller, which sends them through `send`; so the writer changes the cost of a chunk, never
the bytes on the wire, their order, or the flow control.
"""

from __future__ import annotations

import weakref

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class CycleChunkWriter:
    """The writer for one request/response cycle of one client connection.

    It holds its cycle weakly: the writer lives in the cycle's scope, and a strong
    reference back would make every request's cycle, scope and event a reference cycle
    that only the garbage collector frees (measured: about ten container objects per
    request, kept until a full collection: 12,442 such objects reached the collector in
    9 s at 100 streams). A writer whose cycle is gone refuses."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def __call__(self, chunk: bytes) -> bool:
        cycle = self._cycle()
        if (cycle is None or not cycle.response_started or cycle.response_complete
                or cycle.disconnected or cycle.chunked_encoding is not True
                or cycle.flow.write_paused or cycle.transport.is_closing()
                or cycle.scope["method"] == "HEAD"):
            return False
        if chunk:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True
