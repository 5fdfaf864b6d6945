"""The router's loop accepts a burst of new connections in a few turns, not one per turn,
and stops accepting when its server closes."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from typing import cast

import pytest
import uvicorn
import uvloop

from specrouter.commands.serve import uvicorn_options
from specrouter.config import load_settings
from specrouter.edge.accept import ACCEPT_BURST, BurstAcceptLoop, BurstServer

BURST = 2 * ACCEPT_BURST
#: Turns a queued burst of BURST may take: two of accepting, then each connection's
#: adoption task and its `connection_made`, with room to spare; libuv alone takes BURST.
FEW_TURNS = 8


class Counted(asyncio.Protocol):
    """Counts the connections made; `all_made` is set at `expected`."""

    made = 0
    expected = 0
    all_made: asyncio.Event

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cls = Counted
        cls.made += 1
        if cls.made >= cls.expected:
            cls.all_made.set()


def _count_from(expected: int) -> None:
    Counted.made, Counted.expected, Counted.all_made = 0, expected, asyncio.Event()


def _connect(port: int, count: int) -> list[socket.socket]:
    """`count` connections the kernel completed and queued for the server to accept."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


async def _turns_to_accept(count: int) -> int:
    """Turns of the running loop from a burst of `count` connections queued at once to the
    last one's `connection_made`."""
    server = await asyncio.get_running_loop().create_server(Counted, "127.0.0.1", 0,
                                                            backlog=1024)
    try:
        return await _turns_on(server, count)
    finally:
        server.close()


def _port(server: asyncio.AbstractServer) -> int:
    return int(cast(asyncio.Server, server).sockets[0].getsockname()[1])


async def _turns_on(server: asyncio.AbstractServer, count: int) -> int:
    loop = asyncio.get_running_loop()
    _count_from(count)
    clients = _connect(_port(server), count)  # the loop does not turn while they connect
    turns = 0

    def turn() -> None:
        nonlocal turns
        turns += 1
        if not Counted.all_made.is_set():
            loop.call_soon(turn)

    loop.call_soon(turn)
    try:
        await asyncio.wait_for(Counted.all_made.wait(), timeout=30)
    finally:
        for client in clients:
            client.close()
    return turns


def _run(factory: Callable[[], asyncio.AbstractEventLoop], main: Callable[[], object]) -> object:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())  # type: ignore[arg-type]


def test_a_burst_of_connections_is_accepted_in_a_few_turns() -> None:
    turns = _run(BurstAcceptLoop, lambda: _turns_to_accept(BURST))
    assert isinstance(turns, int) and turns <= FEW_TURNS, turns


def test_uvloop_alone_accepts_one_connection_per_turn() -> None:
    """What the burst accept is for: libuv's own accept takes one connection per turn
    (libuv PR #3696). Should a release accept in a loop again, this fails, and
    `edge.accept` has no more reason to exist."""
    turns = _run(uvloop.Loop, lambda: _turns_to_accept(BURST))
    assert isinstance(turns, int) and turns >= BURST - 2, turns


def test_serve_runs_on_the_burst_accept_loop() -> None:
    settings = load_settings(overrides={"backends": [
        {"name": "b", "url": "http://127.0.0.1:9", "pool": "eagle", "group": "g"}]})
    config = uvicorn.Config(lambda: None, **uvicorn_options(settings))
    assert config.get_loop_factory() is BurstAcceptLoop


async def _closed_server_refuses() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Counted, "127.0.0.1", 0)
    assert isinstance(server, BurstServer)
    port = _port(server)
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_closed_server_accepts_nothing_more() -> None:
    """The duplicate descriptor the burst accept watches closes with the server: nothing
    listens on the port once uvicorn closes it at shutdown."""
    _run(BurstAcceptLoop, _closed_server_refuses)


class _OutOfDescriptors:
    """A listening socket whose accept fails as when the process has no descriptor left."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self._sock.close()


async def _steps_aside() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Counted, "127.0.0.1", 0, backlog=1024)
    assert isinstance(server, BurstServer)
    acceptor = server._acceptors[0]
    real = acceptor._sock
    acceptor._sock = _OutOfDescriptors(real)  # type: ignore[assignment]
    acceptor._accept_burst()  # as when the listening socket is readable
    acceptor._sock = real
    assert acceptor._retry is not None
    try:
        # standing aside, it leaves the connections to uvloop's own accept: one per turn
        assert await _turns_on(server, BURST) >= BURST - 2
        acceptor._retry.cancel()
        acceptor._watch()  # as its retry does
        assert await _turns_on(server, BURST) <= FEW_TURNS
    finally:
        server.close()


def test_out_of_descriptors_the_burst_accept_steps_aside() -> None:
    _run(BurstAcceptLoop, _steps_aside)
