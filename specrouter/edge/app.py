"""The router's ASGI application: OpenAI and SGLang routes in front of the backends.

The request path is written as raw ASGI on purpose. It runs once per request at
thousands of requests per second on a couple of cores, and the byte relay must not
buffer: the body is read once (bounded), peeked for `model` and `stream` without
building the message list, and forwarded untouched; response chunks go to the client
as they arrive.

Lifecycle of one proxied request:
  read body (413 over the limit) -> peek (400 if not JSON) -> router.choose ->
  router.acquire -> upstream.open -> relay -> router.release (always, in `finally`).
A connection failure or a 502/503 before any byte reached the client is retried once
on another backend. A stream the router marked recallable (`Target.recall`) holds its
response head until the first byte: if the router recalls it first, the upstream request
is closed and the request is routed again. While the exchange runs, a watcher task waits
for the client to disconnect and cancels it, which closes the upstream connection so
SGLang aborts the request and frees its batch slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from specrouter.config import Pool, Settings
from specrouter.errors import JSON_HEADERS, RouterError, openai_error_body, sse_error_event
from specrouter.proxy.shadow import ShadowProber, probe_body
from specrouter.proxy.upstream import (
    RawHeaders,
    Upstream,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
    create_upstreams,
)
from specrouter.routing.router import (
    Backend,
    NoBackendAvailable,
    PreferEagleRouter,
    Probe,
    RequestInfo,
    Router,
    Target,
)

log = logging.getLogger("specrouter.proxy")
_T = TypeVar("_T")

_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
# httpx sets host and content-length itself; `expect` is answered by our own server.
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length", b"expect", b"authorization"}
# Our server writes its own date and server lines.
_RESPONSE_DROP = _HOP_BY_HOP | {b"date", b"server"}
_POOL_HEADER = b"x-specrouter-pool"
_REQUEST_ID = b"x-request-id"
_TAIL = 32  # bytes of the stream kept to check that it ended with `data: [DONE]`


class RouteKind(enum.Enum):
    GENERATE = "generate"  # JSON body with model/stream; the routing decision matters
    INFO = "info"  # cheap per-server GET (model_info, server_info)
    OTHER_V1 = "other_v1"  # everything else under /v1: the baseline pool, bytes as-is


class _Peek(BaseModel):
    """The only two fields the router reads; everything else is skipped while parsing."""

    model_config = ConfigDict(extra="ignore")
    model: Any = None
    stream: Any = None


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class _Recalled(Exception):
    """The router recalled this attempt before its first byte: route the request again."""


class _Retry(Exception):
    """This attempt failed before the first byte: try another backend."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class _Watch:
    """Per-request flags shared with the disconnect watcher."""

    client_gone: bool = False
    finished: bool = False  # the final response message is being sent: stop watching


@dataclass(slots=True)
class _RequestHead:
    """The client's request headers, split once into what forwarding needs."""

    forward: RawHeaders
    authorization: bytes | None
    request_id: bytes
    content_length: int | None
    pool_header: str | None

    def upstream_headers(self, backend: Backend, request_id: bytes | None = None) -> RawHeaders:
        """Headers for one backend: its own API key replaces the client's credentials;
        `request_id` replaces the client's id (a shadow probe carries its own)."""
        headers = list(self.forward)
        if backend.api_key is not None:
            headers.append((b"authorization", b"Bearer " + backend.api_key.encode()))
        elif self.authorization is not None:
            headers.append((b"authorization", self.authorization))
        headers.append((_REQUEST_ID, request_id if request_id is not None else self.request_id))
        return headers


def _parse_head(scope: Scope) -> _RequestHead:
    forward: RawHeaders = []
    authorization = request_id = content_length = pool_header = None
    connection_tokens: frozenset[bytes] = frozenset()
    for key, value in scope["headers"]:
        if key in _REQUEST_DROP:
            if key == b"authorization":
                authorization = value
            elif key == b"content-length":
                content_length = value
            elif key == b"connection":
                connection_tokens = frozenset(t.strip().lower() for t in value.split(b","))
            continue
        if key == _REQUEST_ID:
            request_id = value
            continue
        if key == _POOL_HEADER:
            pool_header = value.decode("latin-1")
        forward.append((key, value))
    if connection_tokens:
        forward = [(k, v) for k, v in forward if k not in connection_tokens]
    return _RequestHead(
        forward=forward,
        authorization=authorization,
        request_id=_valid_request_id(request_id),
        content_length=_parse_length(content_length),
        pool_header=pool_header,
    )


def _valid_request_id(value: bytes | None) -> bytes:
    """The client's id if it is a sane token, else a fresh one (ids end up in logs)."""
    if value and len(value) <= 128 and all(33 <= c < 127 for c in value):
        return value
    return uuid.uuid4().hex.encode()


def _parse_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise RouterError(400, "invalid Content-Length header") from None


async def _read_body(receive: Receive, declared: int | None, limit: int) -> bytes:
    """The whole request body, refused with 413 as soon as it exceeds `limit`."""
    if declared is not None and declared > limit:
        raise RouterError(413, f"request body of {declared} bytes exceeds the {limit} byte limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"request body exceeds the {limit} byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _peek(body: bytes) -> _Peek:
    if not body:
        raise RouterError(400, "request body is empty: expected a JSON object")
    try:
        return _Peek.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "model_type":
            raise RouterError(400, "request body must be a JSON object") from None
        raise RouterError(400, f"request body is not valid JSON: {error['msg']}") from None


def _is_event_stream(headers: RawHeaders) -> bool:
    for key, value in headers:
        if key.lower() == b"content-type":
            return value.lower().startswith(b"text/event-stream")
    return False


def _ended_with_done(tail: bytes) -> bool:
    return tail.rstrip().endswith(b"data: [DONE]")


def _at_event_boundary(tail: bytes) -> bool:
    return not tail or tail.endswith((b"\n\n", b"\r\n\r\n"))


def _target_headers(target: Target, request_id: bytes) -> RawHeaders:
    return [
        (b"x-specrouter-pool", target.pool.encode()),
        (b"x-specrouter-backend", target.backend.name.encode()),
        (b"x-specrouter-reason", target.reason.encode()),
        (_REQUEST_ID, request_id),
    ]


def _response_headers(
    upstream: RawHeaders, target: Target, request_id: bytes, content_length: int | None = None
) -> RawHeaders:
    """Upstream headers minus hop-by-hop ones, plus ours. Content-Length is always ours:
    `content_length` for a buffered body, none (chunked) for a stream, which may gain an
    error event the upstream never sent."""
    headers: RawHeaders = []
    for key, value in upstream:
        lower = key.lower()
        if lower in _RESPONSE_DROP or lower == _REQUEST_ID or lower == b"content-length":
            continue
        headers.append((lower, value))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    headers.extend(_target_headers(target, request_id))
    return headers


async def _send_json(
    send: Send, status: int, body: bytes, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], watch: _Watch) -> None:
    """Cancel the request's task the moment the client goes away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not watch.finished:
                watch.client_gone = True
                task.cancel()
            return


class Proxy:
    """Forwards requests to the backend the router chooses; see the module docstring."""

    def __init__(
        self, settings: Settings, router: Router, upstreams: Mapping[str, Upstream]
    ) -> None:
        self.router = router
        self.upstreams = upstreams
        self._max_body = settings.limits.max_body_bytes
        self._body_timeout = settings.limits.body_timeout_s
        self._total_timeout = settings.timeouts.total
        self._retry = settings.retry.enabled
        self._retry_statuses = frozenset(settings.retry.retry_statuses)
        # Optional router hook, awaited once before the first `choose` of a request (the
        # load-aware router uses it to see a burst of simultaneous arrivals whole).
        self._settle = getattr(router, "settle", None)
        self.prober = ShadowProber(router, upstreams, settings.timeouts.total)

    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: RouteKind) -> None:
        try:
            head = _parse_head(scope)
            # A client trickling its body must not hold the request (and its memory) forever.
            async with asyncio.timeout(self._body_timeout):
                body = await _read_body(receive, head.content_length, self._max_body)
            info = self._request_info(kind, scope, body, head)
        except RouterError as err:
            await _send_json(send, err.status, err.body(), [(_REQUEST_ID, _request_id(scope))])
            return
        except _ClientGone:
            return
        except TimeoutError:
            late = RouterError(408, f"request body not received within {self._body_timeout:g} s")
            await _send_json(send, late.status, late.body(), [(_REQUEST_ID, _request_id(scope)),
                                                              (b"connection", b"close")])
            return
        await self._run_watched(scope, receive, send, info, body, head)

    def _request_info(
        self, kind: RouteKind, scope: Scope, body: bytes, head: _RequestHead
    ) -> RequestInfo:
        path: str = scope["path"]
        if kind is RouteKind.GENERATE:
            peek = _peek(body)
            model = peek.model if isinstance(peek.model, str) else None
            return RequestInfo(path, model, peek.stream is True, None, head.pool_header)
        pool: Pool | None = "baseline" if kind is RouteKind.OTHER_V1 else None
        return RequestInfo(path, None, False, pool, head.pool_header)

    async def _run_watched(
        self, scope: Scope, receive: Receive, send: Send, info: RequestInfo,
        body: bytes, head: _RequestHead,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch()
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, watch))
        try:
            await self._forward(scope, send, info, body, head, watch)
        except asyncio.CancelledError:
            # Our own watcher cancelled us because the client left: the upstream is
            # already closed by the `finally` blocks below; nothing more to answer.
            if watch.client_gone and task.uncancel() == 0:
                return
            raise
        finally:
            watch.finished = True
            watcher.cancel()

    async def _forward(
        self, scope: Scope, send: Send, info: RequestInfo, body: bytes,
        head: _RequestHead, watch: _Watch,
    ) -> None:
        method: str = scope["method"]
        path = _path_and_query(scope)
        tried: frozenset[str] = frozenset()
        failed: _Retry | None = None
        if self._settle is not None:
            burst_ahead = await self._settle(info)
            if burst_ahead:
                info = replace(info, burst_ahead=burst_ahead)
        while True:
            try:
                target = self.router.choose(replace(info, exclude=tried) if tried else info)
            except NoBackendAvailable as exc:
                watch.finished = True
                err = (RouterError(503, str(exc), code="no_backend") if failed is None
                       else RouterError(failed.status, failed.message))
                await _send_json(send, err.status, err.body(), [(_REQUEST_ID, head.request_id)])
                return
            except RouterError as err:  # the router refused the request (e.g. a bad header)
                watch.finished = True
                await _send_json(send, err.status, err.body(), [(_REQUEST_ID, head.request_id)])
                return
            if target.probe is not None:
                self._send_probe(target.probe, path, head, body)
            may_retry = self._retry and not tried
            self.router.acquire(target)
            try:
                await self._attempt(send, target, method, path, body, head, info.stream,
                                    watch, may_retry)
                return
            except _Retry as retry:
                tried, failed = tried | {target.backend.name}, retry
                log.info("request %s: retrying after %s", head.request_id.decode(), retry.message)
            except _Recalled:
                info = replace(info, recalled=True)
                log.info("request %s: recalled from %s before its first byte",
                         head.request_id.decode(), target.backend.name)
            finally:
                self.router.release(target)

    def _send_probe(self, probe: Probe, path: str, head: _RequestHead, body: bytes) -> None:
        shadow = probe_body(path, body, probe.max_tokens)
        if shadow is None:
            return
        # Its own request id, so the engine's logs never mix it up with the client's.
        headers = head.upstream_headers(probe.target.backend, head.request_id + b"-probe")
        self.prober.send(probe.target, path, headers, shadow)

    async def _attempt(
        self, send: Send, target: Target, method: str, path: str, body: bytes,
        head: _RequestHead, stream: bool, watch: _Watch, may_retry: bool,
    ) -> None:
        name = target.backend.name
        try:
            response = await _unless_recalled(self.upstreams[name].open(
                method, path, head.upstream_headers(target.backend), body, stream=stream
            ), target.recall)
        except UpstreamUnreachable as exc:
            self.router.record_outcome(name, False, str(exc))
            message = f"backend {name} unreachable: {exc}"
            if may_retry and self._has_alternative(target):
                raise _Retry(502, message) from exc
            await self._fail(send, target, head, watch, 502, message)
            return
        except UpstreamTimeout as exc:
            self.router.record_outcome(name, False, str(exc))
            await self._fail(send, target, head, watch, 504, f"backend {name} timed out: {exc}")
            return
        except UpstreamError as exc:
            self.router.record_outcome(name, False, str(exc))
            await self._fail(send, target, head, watch, 502, f"backend {name} failed: {exc}")
            return
        try:
            status = response.status
            if status in self._retry_statuses and may_retry and self._has_alternative(target):
                self.router.record_outcome(name, False, f"HTTP {status}")
                raise _Retry(status, f"backend {name} answered HTTP {status}")
            if _is_event_stream(response.headers):
                error = await self._relay_stream(send, response, target, head, watch)
            else:
                error = await self._relay_buffered(send, response, target, head, watch)
            if error is None and status >= 500:
                error = f"HTTP {status}"
            self.router.record_outcome(name, error is None, error)
        finally:
            await response.aclose()

    def _has_alternative(self, target: Target) -> bool:
        """Whether a retry could land anywhere: without one, answer the first failure."""
        name = target.backend.name
        return any(b.name != name and self.router.healthy(b.name) for b in self.router.backends)

    async def _fail(
        self, send: Send, target: Target, head: _RequestHead, watch: _Watch,
        status: int, message: str,
    ) -> None:
        log.warning("request %s: %s", head.request_id.decode(), message)
        watch.finished = True
        body = openai_error_body(status, message)
        await _send_json(send, status, body, _target_headers(target, head.request_id))

    async def _relay_stream(
        self, send: Send, response: UpstreamResponse, target: Target, head: _RequestHead,
        watch: _Watch,
    ) -> str | None:
        """Pass SSE chunks through as they arrive; end a broken stream with an error event.
        Returns what went wrong upstream, if anything. A recallable stream sends its head
        with its first byte, and raises _Recalled if the router recalls it before that."""
        headers = _response_headers(response.headers, target, head.request_id)
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        started = target.recall is None
        if started:
            await send(start)
        tail = b""
        error: str | None = None
        code = 502
        try:
            chunks = (response.iter_raw() if target.recall is None
                      else _recallable_chunks(response, target.recall))
            async for chunk in chunks:
                if not chunk:
                    continue
                if not started:
                    await send(start)
                    started = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
        except UpstreamTimeout as exc:
            error, code = f"backend went silent: {exc}", 504
        except UpstreamError as exc:
            error = f"backend stream failed: {exc}"
        else:
            if not _ended_with_done(tail):
                error = "backend closed the stream before [DONE]"
        trailer = b"" if error is None else _stream_error_trailer(target, tail, error, code)
        watch.finished = True
        if not started:
            await send(start)
        await send({"type": "http.response.body", "body": trailer, "more_body": False})
        return error

    async def _relay_buffered(
        self, send: Send, response: UpstreamResponse, target: Target, head: _RequestHead,
        watch: _Watch,
    ) -> str | None:
        """A non-SSE body: read it whole (bounded by `total`), so a failure while reading
        can still be answered with a proper status instead of a truncated body."""
        name = target.backend.name
        try:
            async with asyncio.timeout(self._total_timeout):
                chunks = [chunk async for chunk in response.iter_raw()]
        except (UpstreamTimeout, TimeoutError) as exc:
            message = f"backend {name} timed out: {exc or 'total timeout'}"
            await self._fail(send, target, head, watch, 504, message)
            return message
        except UpstreamError as exc:
            message = f"backend {name} failed: {exc}"
            await self._fail(send, target, head, watch, 502, message)
            return message
        body = b"".join(chunks)
        headers = _response_headers(response.headers, target, head.request_id, len(body))
        watch.finished = True
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return None


async def _recallable_chunks(response: UpstreamResponse, recall: asyncio.Event
                             ) -> AsyncIterator[bytes]:
    """The response's chunks; until the first non-empty one, a recall of the request
    raises _Recalled instead."""
    chunks = response.iter_raw()
    first = await _unless_recalled(_first_chunk(chunks), recall)
    if first is None:
        return
    yield first
    async for chunk in chunks:
        yield chunk


async def _first_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    async for chunk in chunks:
        if chunk:
            return chunk
    return None


async def _unless_recalled(work: Awaitable[_T], recall: asyncio.Event | None) -> _T:
    """`await work`, unless `recall` is set first: then `work` is cancelled (closing its
    upstream connection, so SGLang aborts the request) and _Recalled is raised. A result
    that is ready when the recall comes wins, and so does one that `work` returned while
    being cancelled: it is the caller's to close (a response then meets the recall at
    its first chunk)."""
    if recall is None:
        return await work
    task = asyncio.ensure_future(work)
    recalled = asyncio.ensure_future(recall.wait())
    try:
        await asyncio.wait((task, recalled), return_when=asyncio.FIRST_COMPLETED)
    finally:
        recalled.cancel()
        if not task.done():  # recalled, or this request was cancelled (client gone)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled() or (recall.is_set() and task.exception() is not None):
        raise _Recalled
    return task.result()


def _stream_error_trailer(target: Target, tail: bytes, message: str, code: int) -> bytes:
    name = target.backend.name
    log.warning("stream from %s broke: %s", name, message)
    event = sse_error_event(f"{message} (backend {name})", code=code)
    # A cut inside an event would glue our event onto it; end that line first.
    return event if _at_event_boundary(tail) else b"\n\n" + event


def _path_and_query(scope: Scope) -> str:
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1")
    query: bytes = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def _request_id(scope: Scope) -> bytes:
    for key, value in scope["headers"]:
        if key == _REQUEST_ID:
            return _valid_request_id(value)
    return _valid_request_id(None)


class ProxyRoute:
    """ASGI endpoint binding one route to the proxy (Starlette treats it as an app)."""

    def __init__(self, proxy: Proxy, kind: RouteKind) -> None:
        self._proxy = proxy
        self._kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy.handle(scope, receive, send, self._kind)


# --- routes the router answers itself --------------------------------------------------


class ModelsRoute:
    """GET /v1/models: the union of every healthy backend's models, deduplicated by id."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = _parse_head(scope)
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
        extra = [(_REQUEST_ID, head.request_id)]
        if models or (not refusals and any(isinstance(a, list) for a in answers)):
            body = json.dumps({"object": "list", "data": list(models.values())}).encode()
            await _send_json(send, 200, body, extra)
        elif refusals:  # e.g. every backend said 401: the client should see why
            status, body = refusals[0]
            await _send_json(send, status, body, extra)
        else:
            body = openai_error_body(502, "no backend answered /v1/models")
            await _send_json(send, 502, body, extra)

    async def _fetch(
        self, backend: Backend, head: _RequestHead
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


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


@dataclass
class Lifecycle:
    """Shared by the app and the server: `draining` is set on SIGTERM (see
    `specrouter.commands.serve`), `active` counts requests in progress outside `DRAIN_OPEN`."""

    draining: bool = False
    active: int = 0


#: Paths still answered while draining: probes and scrapes must see the router going away.
DRAIN_OPEN = frozenset({"/health", "/ready", "/metrics"})


def _ready_endpoint(router: Router, lifecycle: Lifecycle) -> Any:
    async def ready(request: Request) -> Response:
        details = router.details()
        is_ready = not lifecycle.draining and any(router.healthy(b.name) for b in router.backends)
        return JSONResponse({"ready": is_ready, "draining": lifecycle.draining, **details},
                            status_code=200 if is_ready else 503)

    return ready


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = "not found" if exc.status_code == 404 else str(exc.detail)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    body = openai_error_body(exc.status_code, message)
    return Response(body, exc.status_code, media_type="application/json", headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return Response(openai_error_body(500, "internal router error"), 500,
                    media_type="application/json")


_ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def proxy_routes(proxy: Proxy) -> list[BaseRoute]:
    generate = ProxyRoute(proxy, RouteKind.GENERATE)
    info = ProxyRoute(proxy, RouteKind.INFO)
    return [
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/models", ModelsRoute(proxy), methods=["GET"]),
        *(Route(p, info, methods=["GET"]) for p in
          ("/model_info", "/get_model_info", "/server_info", "/get_server_info")),
        Route("/v1/{rest:path}", ProxyRoute(proxy, RouteKind.OTHER_V1), methods=_ALL_METHODS),
    ]


class SpecRouterApp:
    """The ASGI entry point: the hot generation routes go straight to the proxy, the
    rest through Starlette.

    Starlette's router and its two middlewares wrap every `send`; on a stream of
    thousands of chunks per second that is measurable, and these three routes need
    none of it. `.starlette` is the full app (admin routes, error pages, lifespan).
    """

    _HOT: Mapping[tuple[str, str], RouteKind] = {
        ("POST", "/v1/chat/completions"): RouteKind.GENERATE,
        ("POST", "/v1/completions"): RouteKind.GENERATE,
        ("POST", "/generate"): RouteKind.GENERATE,
    }

    def __init__(self, starlette: Starlette, proxy: Proxy, lifecycle: Lifecycle) -> None:
        self.starlette = starlette
        self.proxy = proxy
        self.state = starlette.state
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in DRAIN_OPEN:
            await self.starlette(scope, receive, send)
            return
        life = self.lifecycle
        if life.draining:
            body = openai_error_body(503, "the router is shutting down: retry on another "
                                          "replica", code="shutting_down")
            await _send_json(send, 503, body, [(b"connection", b"close")])
            return
        life.active += 1
        try:
            kind = self._HOT.get((scope["method"], scope["path"]))
            if kind is not None:
                await self._guarded(scope, receive, send, kind)
            else:
                await self.starlette(scope, receive, send)
        finally:
            life.active -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, kind: RouteKind) -> None:
        try:
            await self.proxy.handle(scope, receive, send, kind)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            with contextlib.suppress(Exception):  # fails if the response already started
                await _send_json(send, 500, openai_error_body(500, "internal router error"))


def create_app(
    settings: Settings,
    router: Router | None = None,
    upstreams: Mapping[str, Upstream] | None = None,
    extra_routes: Sequence[BaseRoute] = (),
) -> SpecRouterApp:
    """The ASGI app. `router` defaults to PreferEagleRouter; `extra_routes` (admin,
    metrics) are matched before the proxied `/v1/*` catch-all."""
    backends = [Backend.from_config(b) for b in settings.backends]
    router = router if router is not None else PreferEagleRouter(backends)
    owned = upstreams is None
    upstreams = upstreams if upstreams is not None else create_upstreams(
        router.backends, settings.timeouts, settings.upstream
    )
    proxy = Proxy(settings, router, upstreams)
    lifecycle = Lifecycle()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await proxy.prober.aclose()
            await router.stop()
            if owned:
                await asyncio.gather(*(u.aclose() for u in upstreams.values()))

    routes: list[BaseRoute] = [
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready_endpoint(router, lifecycle), methods=["GET"]),
        *extra_routes,
        *proxy_routes(proxy),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    app.state.router = router
    return SpecRouterApp(app, proxy, lifecycle)
