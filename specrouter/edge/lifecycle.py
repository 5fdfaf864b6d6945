"""The router's own lifecycle as clients see it: /health, /ready, and the drain flag."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specrouter.routing.router import Router

#: Paths still answered while draining: health checks and scrapes must see the router
#: going away.
DRAIN_OPEN = frozenset({"/health", "/ready", "/metrics"})


@dataclass
class Lifecycle:
    """Shared by the app and the server: `draining` is set on SIGTERM (see
    `specrouter.commands.serve`), `active` counts requests in progress outside `DRAIN_OPEN`."""

    draining: bool = False
    active: int = 0

    def count(self, change: int) -> None:
        """A request on the callback path began (1) or ended (-1)."""
        self.active += change


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def lifecycle_routes(router: Router, lifecycle: Lifecycle) -> list[Route]:
    """/health answers while the process runs; /ready only while it is not draining and
    a backend is healthy."""

    async def ready(request: Request) -> Response:
        details = router.details()
        is_ready = not lifecycle.draining and any(router.healthy(b.name) for b in router.backends)
        return JSONResponse({"ready": is_ready, "draining": lifecycle.draining, **details},
                            status_code=200 if is_ready else 503)

    return [
        Route("/health", _health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
    ]
