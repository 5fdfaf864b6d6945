"""GET /v1/models, answered by the router itself: the union of every healthy backend's
models, deduplicated by id."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Receive, Scope, Send

from specrouter.backends import Backend
from specrouter.errors import openai_error_body
from specrouter.proxy.forward import Proxy
from specrouter.proxy.request import REQUEST_ID, RequestHead, parse_head
from specrouter.proxy.response import send_json
from specrouter.proxy.upstream import UpstreamError


class ModelsRoute:
    """ASGI endpoint. When no backend lists a model, a refusal (e.g. every backend said
    401) is passed on so the client sees why; with no answer at all it is a 502."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = parse_head(scope)
        router = self._proxy.router
        backends = [b for b in router.backends if router.healthy(b.name)] or list(router.backends)
        answers = await asyncio.gather(*(self._fetch(b, head) for b in backends))
        models: dict[str, Any] = {}
        refusals: list[tuple[int, bytes]] = []
        for answer in answers:
            if isinstance(answer, list):
                for model in answer:
                    if isinstance(model, dict) and isinstance(model.get("id"), str):
                        models.setdefault(model["id"], model)
            elif answer is not None:
                refusals.append(answer)
        extra = [(REQUEST_ID, head.request_id)]
        if models or (not refusals and any(isinstance(a, list) for a in answers)):
            body = json.dumps({"object": "list", "data": list(models.values())}).encode()
            await send_json(send, 200, body, extra)
        elif refusals:
            status, body = refusals[0]
            await send_json(send, status, body, extra)
        else:
            body = openai_error_body(502, "no backend answered /v1/models")
            await send_json(send, 502, body, extra)

    async def _fetch(
        self, backend: Backend, head: RequestHead
    ) -> list[Any] | tuple[int, bytes] | None:
        """The backend's model list, its refusal (status, body), or None if unreachable."""
        upstream = self._proxy.upstreams[backend.name]
        try:
            response = await upstream.open(
                "GET", "/v1/models", head.upstream_headers(backend), b"", stream=False
            )
            try:
                body = b"".join([chunk async for chunk in response.iter_raw()])
            finally:
                await response.aclose()
        except UpstreamError as exc:
            self._proxy.router.record_outcome(backend.name, False, str(exc))
            return None
        if response.status != 200:
            return (response.status, body)
        try:
            data = json.loads(body).get("data")
        except (ValueError, AttributeError):
            return None
        return data if isinstance(data, list) else None
