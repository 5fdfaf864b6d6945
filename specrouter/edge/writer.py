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

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class CycleChunkWriter:
    """The writer for one request/response cycle of one client connection."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def __call__(self, chunk: bytes) -> bool:
        cycle = self._cycle
        if (not cycle.response_started or cycle.response_complete or cycle.disconnected
                or cycle.chunked_encoding is not True or cycle.flow.write_paused
                or cycle.transport.is_closing() or cycle.scope["method"] == "HEAD"):
            return False
        if chunk:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True
