"""What a Python relay on this stack costs: proxies that do nothing but relay, one of them
with specrouter's router in the loop.

    python -m loadtest.floor_proxy --kind asgi|protocol|routed|task --port 8001 --upstream URL

They are reference rows (the `peer` scenario's `asgi`, `protocol` and `routed`; `task` for
`loadtest.ab`), not products: no limits, no error handling beyond closing a broken
exchange, one upstream.

- `asgi`: specrouter's own stack with nothing of specrouter on it: uvicorn with httptools
  and uvloop (`proxy_headers` off, as `serve` runs it), a raw ASGI app that reads the body,
  opens the request on specrouter's native transport and relays every chunk through
  `send`. The gap between it and specrouter is what the router's own work costs.
- `protocol`: no ASGI server and no HTTP client library: asyncio protocols on uvloop,
  httptools parsing both ways, the client's request (its path and body, as a JSON POST)
  re-sent on a pooled keep-alive upstream connection and the upstream's response bytes
  written to the client's socket as they arrive. The gap between it and `asgi` is what
  uvicorn's request cycle and the transport's awaitable exchange cost.
- `routed`: `protocol` with specrouter's router in the loop, as a request path below
  uvicorn's cycle would run it: the router of `specrouter.assembly` (its telemetry polls
  and health checks running, the upstream its one backend) reads each request's head and
  body (`parse_head`, `request_info`), chooses and acquires a backend before the request
  goes out, and releases it, records the outcome and observes the request's metrics when
  the answer ends. None of the proxy's cycle (rids, the first event's check, usage,
  aborts, limits): the gap between it and `protocol` is the routing work alone, run on
  callbacks.
- `task`: `asgi` without uvicorn: the `protocol` floor's client side, and per request one
  task that opens the exchange on the native transport and writes the head and each
  chunk `iter_raw` yields to the client's socket. Between it and `asgi` lies uvicorn's
  request cycle; between it and `protocol` the task and the transport's awaitable
  exchange.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import uvicorn
import uvloop

from specrouter.assembly import Product, build_product
from specrouter.backends import Backend
from specrouter.config import (
    AffinitySettings,
    LimitSettings,
    TimeoutSettings,
    UpstreamSettings,
    load_settings,
)
from specrouter.proxy.request import RouteKind, parse_head, request_info
from specrouter.proxy.transports.native import NativeUpstream
from specrouter.routing.router import Target

KINDS = ("asgi", "protocol", "routed", "task")
_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def asgi_app(upstream_url: str) -> Any:
    """The `asgi` floor's app: body in, the native transport's chunks out through `send`."""
    upstream = NativeUpstream(Backend("floor", upstream_url, "baseline", "floor"),
                              TimeoutSettings(), UpstreamSettings(), LimitSettings())

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k == b"content-type"]
        response = await upstream.open(scope["method"], scope["path"], headers, body,
                                       stream=True)
        try:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": [(k, v) for k, v in response.headers
                                    if k == b"content-type"]})
            async for chunk in response.iter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    return app


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to the upstream; relays its bytes to `client`."""

    def __init__(self, idle: list[_Upstream]) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.idle = idle
        self.client: _Client | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None:
            client.transport.write(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self.idle.append(self)
        if client is not None:
            client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.idle:
            self.idle.remove(self)
        client, self.client = self.client, None
        if client is not None and client.transport is not None:
            client.transport.close()


class _Client(asyncio.Protocol):
    """One client connection: each request goes out on an idle upstream connection."""

    def __init__(self, host: str, port: int, idle: list[_Upstream]) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.host, self.port, self.idle = host, port, idle
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def answered(self) -> None:
        """The upstream's answer to this client's request ended."""

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.transport is None:
            return
        if self.url == b"/health":
            self.transport.write(_HEALTH)
            return
        self.forward(b"".join(self.body))

    def forward(self, body: bytes) -> None:
        """The request, with `body`, out on an idle upstream connection (or a new one)."""
        request = (b"POST %b HTTP/1.1\r\nhost: %b:%d\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%b"
                   % (self.url, self.host.encode(), self.port, len(body), body))
        if self.idle:
            upstream = self.idle.pop()
            upstream.client = self
            assert upstream.transport is not None
            upstream.transport.write(request)
        else:
            asyncio.get_running_loop().create_task(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, upstream = await loop.create_connection(
                lambda: _Upstream(self.idle), self.host, self.port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        upstream.client = self
        transport.write(request)


class _RoutedClient(_Client):
    """`_Client` with the router's per-request work around each exchange (`routed`)."""

    def __init__(self, host: str, port: int, idle: list[_Upstream], product: Product,
                 affinity: AffinitySettings | None) -> None:
        super().__init__(host, port, idle)
        self.product, self.affinity = product, affinity
        self.headers: list[tuple[bytes, bytes]] = []
        self.target: Target | None = None
        self.started = 0.0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def forward(self, body: bytes) -> None:
        self.started = time.perf_counter()
        path = self.url.decode("latin-1")
        scope = {"type": "http", "method": "POST", "path": path, "headers": self.headers,
                 "query_string": b""}
        info = request_info(RouteKind.GENERATE, path, body, parse_head(scope), self.affinity)
        router = self.product.router
        self.target = router.choose(info)
        router.acquire(self.target)
        super().forward(body)

    def answered(self) -> None:
        target, self.target = self.target, None
        if target is None:
            return
        router = self.product.router
        router.release(target)
        router.record_outcome(target.backend.name, True)
        took = time.perf_counter() - self.started
        self.product.metrics.observe_request(target.pool, target.backend.name, 200, took, took)


class _TaskClient(_Client):
    """`_Client` whose exchange is the `asgi` floor's app without uvicorn (`task`): one
    task per request opens it on the native transport and writes the head and every chunk
    it reads from `iter_raw` to the client's transport, chunked."""

    def __init__(self, host: str, port: int, idle: list[_Upstream], upstream: NativeUpstream,
                 ) -> None:
        super().__init__(host, port, idle)
        self.upstream = upstream

    def forward(self, body: bytes) -> None:
        asyncio.get_running_loop().create_task(self._relay(self.url.decode("latin-1"), body))

    async def _relay(self, path: str, body: bytes) -> None:
        response = await self.upstream.open("POST", path, [(b"content-type",
                                                             b"application/json")], body,
                                            stream=True)
        try:
            if self.transport is None:
                return
            self.transport.write(_STREAM_HEAD % response.status)
            async for chunk in response.iter_raw():
                if self.transport is None:
                    return
                self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            if self.transport is not None:
                self.transport.write(b"0\r\n\r\n")
        finally:
            await response.aclose()


_STREAM_HEAD = (b"HTTP/1.1 %d OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")


async def serve_protocol(port: int, upstream_url: str, kind: str = "protocol") -> None:
    """The `protocol` floor, or one of its variants `routed` and `task` (module
    docstring), on 127.0.0.1:`port` until cancelled."""
    parts = urlsplit(upstream_url)
    host, upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
    idle: list[_Upstream] = []
    loop = asyncio.get_running_loop()
    if kind == "task":
        upstream = NativeUpstream(Backend("floor", upstream_url, "baseline", "floor"),
                                  TimeoutSettings(), UpstreamSettings(), LimitSettings())
        server = await loop.create_server(
            lambda: _TaskClient(host, upstream_port, idle, upstream), "127.0.0.1", port)
    elif kind == "routed":
        settings = load_settings(overrides={"backends": [
            {"name": "floor", "url": upstream_url, "pool": "eagle", "group": "gpu0"}]})
        product = build_product(settings)
        affinity = settings.affinity if settings.affinity.enabled else None
        await product.router.start()
        server = await loop.create_server(
            lambda: _RoutedClient(host, upstream_port, idle, product, affinity),
            "127.0.0.1", port)
    else:
        server = await loop.create_server(lambda: _Client(host, upstream_port, idle),
                                          "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL of the upstream")
    args = parser.parse_args()
    if args.kind == "asgi":
        uvicorn.run(asgi_app(args.upstream), host="127.0.0.1", port=args.port, loop="uvloop",
                    http="httptools", proxy_headers=False, log_level="warning",
                    access_log=False)
    else:
        uvloop.run(serve_protocol(args.port, args.upstream, args.kind))


if __name__ == "__main__":
    main()
