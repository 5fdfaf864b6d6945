"""The router's event loop: uvloop, with new connections accepted a burst at a time.

libuv, under uvloop, accepts one connection each time the loop polls (libuv 1.45 and
later, libuv PR #3696). Under load one turn of the router's loop takes milliseconds to
tens of milliseconds, so a burst of N new connections waits up to N turns in the kernel's
accept queue before its first request is read: seconds, for a burst of a few hundred
(docs/router.md section 6). asyncio's own loop accepts up to the server's backlog per
readiness for this reason (bpo-27906).

`BurstAcceptLoop.create_server` keeps uvloop's server and watches a duplicate of each
listening socket, accepting up to `ACCEPT_BURST` connections each time it is readable and
handing each to `connect_accepted_socket`, which makes the same transport uvloop's server
makes (TCP_NODELAY, the protocol's `connection_made`). uvloop's own accept keeps running
and finds the queue empty (EAGAIN, which libuv ignores). Closing the server stops both.
When the process runs out of descriptors, the burst accept steps aside for
`ACCEPT_RETRY_S` and leaves libuv's own accept (which sheds such connections) to it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, cast

import uvloop

log = logging.getLogger("specrouter.edge.accept")

#: Connections accepted per readiness of a listening socket at most: a burst of hundreds
#: is taken in a few turns of the loop, and a flood cannot hold one turn for long.
ACCEPT_BURST = 32
#: Descriptors a flood of connections holds beyond those served and refusals pending: one
#: turn's burst, and the previous turn's refused connections still closing (uvloop
#: releases a descriptor a turn after `close`). The descriptor budget reserves them.
ACCEPT_RESERVE = 2 * ACCEPT_BURST
#: How long the burst accept steps aside when the process has no descriptor left.
ACCEPT_RETRY_S = 1.0
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class BurstServer:
    """uvloop's server and the burst accept beside it; anything else is uvloop's."""

    def __init__(self, server: asyncio.Server, acceptors: list[BurstAcceptor]) -> None:
        self._server = server
        self._acceptors = acceptors

    def close(self) -> None:
        for acceptor in self._acceptors:
            acceptor.close()
        self._server.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class BurstAcceptor:
    """Accepts bursts from one listening socket, through a duplicate of its descriptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop, listening: socket.socket,
                 protocol_factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._sock = socket.socket(fileno=os.dup(listening.fileno()))
        self._sock.setblocking(False)
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        self._adopting: set[asyncio.Task[None]] = set()  # held until the transport is made
        self._watch()

    def _watch(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept_burst)

    def _accept_burst(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._step_aside(exc)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _step_aside(self, exc: OSError) -> None:
        if exc.errno not in _OUT_OF_DESCRIPTORS:
            log.warning("accept failed: %s", exc)
        self._loop.remove_reader(self._sock.fileno())
        self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._watch)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:
            conn.close()  # the client left before its transport was made

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


class BurstAcceptLoop(uvloop.Loop):
    """uvloop whose TCP servers without TLS accept bursts of connections at once."""

    async def create_server(self, protocol_factory: Callable[[], asyncio.BaseProtocol],
                            *args: Any, **kwargs: Any) -> asyncio.Server:
        server = cast(asyncio.Server,
                      await super().create_server(protocol_factory, *args, **kwargs))
        if kwargs.get("ssl") is not None:
            return server
        acceptors = [BurstAcceptor(self, listening, protocol_factory)
                     for listening in server.sockets
                     if listening.family in (socket.AF_INET, socket.AF_INET6)]
        return cast(asyncio.Server, BurstServer(server, acceptors))


#: What uvicorn's `loop=` takes: the import string of a callable that makes the loop (an
#: import string survives the trip to worker processes).
LOOP = "specrouter.edge.accept:BurstAcceptLoop"
