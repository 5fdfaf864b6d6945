"""A real uvicorn server with the router's protocol, for the tests of what the protocol
gives the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from specrouter.edge.guard import BudgetedHttpToolsProtocol


@contextlib.asynccontextmanager
async def guarded_server(app: Any) -> AsyncIterator[int]:
    """`app` served on a free loopback port by uvicorn with the router's protocol; yields
    the port, and stops the server on the way out."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # a client connects now and is accepted once uvicorn serves
    config = uvicorn.Config(app, http=BudgetedHttpToolsProtocol, lifespan="off",
                            log_level=logging.CRITICAL)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving
