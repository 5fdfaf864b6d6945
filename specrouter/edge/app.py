"""The router's ASGI application: OpenAI and SGLang routes in front of the backends.

The generation routes are raw ASGI on purpose: they run once per request at thousands of
requests per second on a couple of cores, and the byte relay must not buffer (see
`specrouter.proxy.forward`). Everything else goes through Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from specrouter.config import Settings
from specrouter.edge.lifecycle import DRAIN_OPEN, Lifecycle, lifecycle_routes
from specrouter.edge.models import ModelsRoute
from specrouter.errors import openai_error_body
from specrouter.proxy.fastpath import CallbackMetrics, FastPath
from specrouter.proxy.forward import Proxy, settle_resumed
from specrouter.proxy.request import RouteKind
from specrouter.proxy.response import send_json
from specrouter.proxy.shadow import CostProber
from specrouter.proxy.upstream import Upstream, create_upstreams
from specrouter.routing.arrivals import GENERATION_PATHS
from specrouter.routing.router import Router

log = logging.getLogger("specrouter.proxy")

#: Cheap per-server GETs, sent to whichever backend the router picks.
INFO_PATHS = ("/model_info", "/get_model_info", "/server_info", "/get_server_info")
_ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class ProxyRoute:
    """ASGI endpoint binding one route to the proxy (Starlette treats it as an app)."""

    def __init__(self, proxy: Proxy, kind: RouteKind) -> None:
        self._proxy = proxy
        self._kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy.handle(scope, receive, send, self._kind)


def proxy_routes(proxy: Proxy) -> list[BaseRoute]:
    generate = ProxyRoute(proxy, RouteKind.GENERATE)
    info = ProxyRoute(proxy, RouteKind.INFO)
    return [
        *(Route(path, generate, methods=["POST"]) for path in sorted(GENERATION_PATHS)),
        Route("/v1/models", ModelsRoute(proxy), methods=["GET"]),
        *(Route(path, info, methods=["GET"]) for path in INFO_PATHS),
        Route("/v1/{rest:path}", ProxyRoute(proxy, RouteKind.OTHER_V1), methods=_ALL_METHODS),
    ]


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    body = openai_error_body(exc.status_code, message)
    return Response(body, exc.status_code, media_type="application/json", headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return Response(openai_error_body(500, "internal router error"), 500,
                    media_type="application/json")


class SpecRouterApp:
    """The ASGI entry point: generation requests go straight to the proxy, the rest
    through Starlette (`.starlette`: admin routes, error pages, lifespan).

    Starlette's router and middlewares wrap every `send`, which is measurable on a
    stream of thousands of chunks per second; the generation routes need none of it.
    While draining, everything outside `DRAIN_OPEN` gets a 503.
    """

    def __init__(self, starlette: Starlette, proxy: Proxy, lifecycle: Lifecycle,
                 fast_path: FastPath | None = None) -> None:
        self.starlette = starlette
        self.proxy = proxy
        self.lifecycle = lifecycle
        # what the server offers a generation request whose body is in (`edge.guard`)
        self.fast_path = fast_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in DRAIN_OPEN:
            await self.starlette(scope, receive, send)
            return
        try:
            await self._serve(scope, receive, send)
        finally:
            settle_resumed(scope)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        life = self.lifecycle
        if life.draining:
            body = openai_error_body(503, "the router is shutting down: retry on another "
                                          "replica", code="shutting_down")
            await send_json(send, 503, body, [(b"connection", b"close")])
            return
        life.active += 1
        try:
            if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
                await self._generate(scope, receive, send)
            else:
                await self.starlette(scope, receive, send)
        finally:
            life.active -= 1

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.proxy.handle(scope, receive, send, RouteKind.GENERATE)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            with contextlib.suppress(Exception):  # fails if the response already started
                await send_json(send, 500, openai_error_body(500, "internal router error"))


def create_app(
    settings: Settings,
    router: Router,
    upstreams: Mapping[str, Upstream] | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    metrics: CallbackMetrics | None = None,
) -> SpecRouterApp:
    """The ASGI app. Without `upstreams` it opens (and at shutdown closes) one client per
    backend; `extra_routes` (admin, metrics) are matched before the `/v1/*` catch-all.
    `metrics` counts the requests the callback path serves (the metrics middleware sees
    the others) and those it hands to the app."""
    owned = upstreams is None
    upstreams = upstreams if upstreams is not None else create_upstreams(
        router.backends, settings.timeouts, settings.upstream, settings.limits
    )
    proxy = Proxy(settings, router, upstreams)
    cost_prober = CostProber.of(router, upstreams, settings.cost_probe)
    lifecycle = Lifecycle()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        if cost_prober is not None:
            await cost_prober.start()
        try:
            yield
        finally:
            if cost_prober is not None:
                await cost_prober.aclose()
            await proxy.aclose()
            await router.stop()
            if owned:
                await asyncio.gather(*(u.aclose() for u in upstreams.values()))

    routes: list[BaseRoute] = [
        *lifecycle_routes(router, lifecycle),
        *extra_routes,
        *proxy_routes(proxy),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    return SpecRouterApp(app, proxy, lifecycle,
                         _fast_path(settings, proxy, lifecycle, metrics))


def _fast_path(settings: Settings, proxy: Proxy, lifecycle: Lifecycle,
               metrics: CallbackMetrics | None) -> FastPath | None:
    """The callback path, where it is on and every backend's transport runs one."""
    if not settings.listen.callback_path:
        return None
    fast = FastPath(proxy, lambda: lifecycle.draining, lifecycle.count, metrics)
    return fast if len(fast.upstreams) == len(proxy.upstreams) else None
