"""Admin API: `GET/PUT/PATCH /policy` and `GET /policy/history`.

GETs are open (they show the policy, its history and the live view, never a secret). Writes need
`Authorization: Bearer <admin token>`, compared in constant time; with no token
configured they are refused outright (403), so a router is never left writable by
accident. The checks run cheapest first and before the body is parsed: token configured
(403), token right (401), body size (413), JSON object (400), valid policy (422 with the
pydantic field errors; the old policy stays in force).

The token is never logged; a refused write is logged with the client address only.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from pydantic import SecretStr, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from specrouter.control.holder import PolicyHolder
from specrouter.errors import RouterError, describe_validation_error

log = logging.getLogger("specrouter.control.admin")

LiveView = Callable[[], dict[str, Any]]


class AdminApi:
    def __init__(
        self,
        holder: PolicyHolder,
        live_view: LiveView | None,
        token: SecretStr | None,
        max_body_bytes: int = 64 * 1024,
    ) -> None:
        self._holder = holder
        self._live_view = live_view
        self._token = token.get_secret_value().encode() if token is not None else None
        self._max_body = max_body_bytes

    def routes(self) -> list[BaseRoute]:
        return [Route("/policy", self._policy, methods=["GET", "PUT", "PATCH"]),
                Route("/policy/history", self._history, methods=["GET"])]

    async def _history(self, request: Request) -> Response:
        """The recent accepted changes, newest first."""
        return JSONResponse({"history": [c.as_dict() for c in self._holder.history()]})

    async def _policy(self, request: Request) -> Response:
        try:
            if request.method == "GET":
                return JSONResponse(_json_safe(self._view()))
            return await self._write(request)
        except RouterError as err:
            headers = {"www-authenticate": "Bearer"} if err.status == 401 else None
            return Response(err.body(), err.status, media_type="application/json",
                            headers=headers)

    def _view(self) -> dict[str, Any]:
        policy = self._holder.current
        view: dict[str, Any] = {"policy": policy.public()}
        if self._live_view is not None:
            view.update(self._live_view())
        return view

    async def _write(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._read_json(request)
        try:
            if request.method == "PUT":
                change = await self._holder.put(body, actor=_client(request))
            else:
                change = await self._holder.patch(body, actor=_client(request))
        except ValidationError as exc:
            return _invalid(exc)
        return JSONResponse({"policy": change.new.public(),
                             "previous_version": change.old.version})

    def _authorize(self, request: Request) -> None:
        if self._token is None:
            raise RouterError(403, "policy writes are disabled: no admin token is configured "
                                   "(set SPECROUTER_ADMIN_TOKEN or admin_token in the config)",
                              code="admin_disabled")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._token):
            log.warning("refused policy write from %s: missing or wrong admin token",
                        _client(request))
            raise RouterError(401, "policy writes need 'Authorization: Bearer <admin token>'",
                              code="unauthorized")

    async def _read_json(self, request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body:
            raise _too_large(self._max_body)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self._max_body:
                    raise _too_large(self._max_body)
                chunks.append(chunk)
        except ClientDisconnect:
            raise RouterError(400, "client disconnected while sending the policy") from None
        try:
            body = json.loads(b"".join(chunks), parse_constant=_no_constant,
                              parse_float=_finite_float)
        except RecursionError:
            raise _too_deep() from None
        except (ValueError, UnicodeDecodeError):
            raise RouterError(400, "policy body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RouterError(400, "policy body must be a JSON object")
        if _depth_exceeds(body, MAX_BODY_DEPTH):
            raise _too_deep()
        return body


#: A policy is a flat object with a few small lists and objects; deeper bodies are refused
#: before validation, so nothing downstream recurses on client input.
MAX_BODY_DEPTH = 16


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity (Python's parser accepts them by default)."""
    raise RouterError(400, f"policy body: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise RouterError(400, f"policy body: the number {text[:32]} is out of range")
    return value


def _too_deep() -> RouterError:
    return RouterError(400, f"policy body is nested more than {MAX_BODY_DEPTH} levels deep")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests lists/objects more than `limit` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return False


def _json_safe(value: Any) -> Any:
    """The live view with non-finite floats (e.g. a group that never switched: since=-inf)
    as null: JSON has no infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _too_large(limit: int) -> RouterError:
    return RouterError(413, f"policy body exceeds the {limit} byte limit")


def _invalid(exc: ValidationError) -> Response:
    errors = [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in exc.errors(include_url=False, include_context=False, include_input=False)
    ]
    summary = describe_validation_error(exc, subject="policy")
    first = ".".join(map(str, errors[0]["loc"])) if errors else None
    body = {"error": {"message": f"invalid policy (the old one stays in force): {summary}",
                      "type": "invalid_request_error", "param": first or None, "code": 422,
                      "errors": errors}}
    return JSONResponse(body, status_code=422)


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "unknown"
