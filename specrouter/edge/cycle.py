"""uvicorn's request/response cycle with the response head held back until the first
part of the body, so that both leave in one write (`CoalescedHeadCycle`).

uvicorn's `send` writes the status line and headers the moment `http.response.start`
arrives and the body's first part with the next message: two writes, two system calls,
for every response, although an ASGI app sends the two back to back (the proxy sends a
stream's head with its first chunk). Holding the head changes when its bytes reach the
socket by the time between the two messages, never the bytes, their order or the flow
control: the held start is processed by uvicorn's own `send`, then the body message, and
what both wrote goes out as one write.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class _Collected:
    """Stands in for the client's transport while uvicorn's `send` writes the held head
    and the first body part: keeps the writes, and a close for after them."""

    __slots__ = ("closed", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True


class CoalescedHeadCycle(RequestResponseCycle):
    """The guard's protocol turns each cycle it starts into one of these (its class is
    swapped before the app's task first runs).

    While the head is held the cycle counts as started (`response_started`), as it does
    for uvicorn once the head is written: the app's next message is taken as the body,
    and an app that fails or returns before sending one has its connection closed as
    after a started response. The chunk writer (`edge.writer`) refuses until the head is
    out, since the body's framing is only known then."""

    held_start: Any = None

    async def send(self, message: Any) -> None:
        if (message["type"] == "http.response.start" and not self.response_started
                and not self.disconnected):
            self.held_start = message
            self.response_started = True
            self.waiting_for_100_continue = False
            return
        start = self.held_start
        if start is None:
            await super().send(message)
            return
        self.held_start = None
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # so that neither `send` below waits
        transport, collected = self.transport, _Collected()
        self.response_started = False
        self.transport = collected  # type: ignore[assignment]
        try:
            await super().send(start)
            await super().send(message)
        finally:
            self.transport = transport
            if collected.parts:
                transport.write(b"".join(collected.parts))
            if collected.closed:
                transport.close()
