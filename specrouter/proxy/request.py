"""What the proxy reads from a client's request: the head, split once into what forwarding
needs, and the body, read whole into one buffer (bounded per request and, through
`BodyBudget`, for the whole process) and peeked for `model` and `stream` without building
the message list. The body is forwarded as the client sent it, with at most fields of the
router's own put first (`with_first_fields`: an attempt's `rid`, the request for a
stream's usage)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails
from starlette.types import Receive, Scope

from specrouter import backends
from specrouter.backends import Backend, Pool
from specrouter.config import AffinitySettings
from specrouter.errors import RouterError
from specrouter.proxy.ids import fresh_id
from specrouter.proxy.upstream import RawHeaders, RequestBody
from specrouter.routing.affinity.keys import SESSION_HEADER, prefix_keys, session_key
from specrouter.routing.router import RequestInfo

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
# The transport writes host and content-length itself, our server answers `expect`, and
# `authorization` is replaced per backend (`RequestHead.upstream_headers`).
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"authorization"}
REQUEST_ID = b"x-request-id"
POOL_HEADER = backends.POOL_HEADER.encode()  # the wire form of the one name
#: The scope extension under which a server offers a `BodyComplete`: whether the request's
#: whole body is in, so that reading it cannot wait.
BODY_COMPLETE = "specrouter.body_complete"
BodyComplete = Callable[[], bool]
#: The scope extension under which the server says how many bytes of the request's body
#: its callback path already took from the body budget (`BodyBudget`) for this request:
#: the app reads the body without taking them again and gives them back when it ends.
BODY_HELD = "specrouter.body_held"
_SESSION = SESSION_HEADER.encode()
_JSON_SPACE = b" \t\r\n"


class RouteKind(enum.Enum):
    GENERATE = "generate"  # JSON body with model/stream; the routing decision matters
    INFO = "info"  # cheap per-server GET (model_info, server_info)
    OTHER_V1 = "other_v1"  # everything else under /v1: the baseline pool, bytes as-is


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


@dataclass(slots=True)
class RequestHead:
    """The client's request headers, split once into what forwarding needs."""

    forward: RawHeaders
    authorization: bytes | None
    request_id: bytes
    content_length: int | None
    pool_header: str | None
    session: str | None = None  # the client's session header (routing.affinity.keys)

    def upstream_headers(self, backend: Backend, request_id: bytes | None = None) -> RawHeaders:
        """Headers for one backend: its own API key replaces the client's credentials;
        `request_id` replaces the client's id (a shadow probe carries its own)."""
        headers = list(self.forward)
        authorization = backend.authorization or self.authorization
        if authorization is not None:
            headers.append((b"authorization", authorization))
        headers.append((REQUEST_ID, request_id if request_id is not None else self.request_id))
        return headers


def parse_head(scope: Scope) -> RequestHead:
    forward: RawHeaders = []
    authorization = request_id = content_length = pool_header = session = None
    connection_tokens: frozenset[bytes] = frozenset()
    for key, value in scope["headers"]:
        if key in _NOT_FORWARDED:
            if key == b"authorization":
                authorization = value
            elif key == b"content-length":
                content_length = value
            elif key == b"connection":
                connection_tokens = frozenset(t.strip().lower() for t in value.split(b","))
            continue
        if key == REQUEST_ID:
            request_id = value
            continue
        if key == POOL_HEADER:
            pool_header = value.decode("latin-1")
        elif key == _SESSION:
            session = value.decode("latin-1")
        forward.append((key, value))
    if connection_tokens:
        forward = [(k, v) for k, v in forward if k not in connection_tokens]
    return RequestHead(
        forward=forward,
        authorization=authorization,
        request_id=valid_request_id(request_id),
        content_length=_parse_length(content_length),
        pool_header=pool_header,
        session=session,
    )


def valid_request_id(value: bytes | None) -> bytes:
    """The client's id if it is a sane token, else a fresh one (ids end up in logs)."""
    if value and len(value) <= 128 and all(33 <= c < 127 for c in value):
        return value
    return fresh_id().encode()


def request_id_of(scope: Scope) -> bytes:
    """The request's id without parsing the rest of its head."""
    for key, value in scope["headers"]:
        if key == REQUEST_ID:
            return valid_request_id(value)
    return valid_request_id(None)


def _parse_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise RouterError(400, "invalid Content-Length header") from None


def path_and_query(scope: Scope) -> str:
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1")
    query: bytes = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


class BodyBudget:
    """The bytes of request bodies this process holds at once, at most `limit`: a request
    whose body would pass it is refused with 503 and `retry-after` instead of memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise RouterError(
                503, f"the router holds {self.held} bytes of request bodies, {size} more would "
                f"pass its {self.limit} byte limit: retry later", code="overloaded",
                retry_after_s=1)
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size


async def read_body(
    receive: Receive, declared: int | None, limit: int, budget: BodyBudget | None
) -> RequestBody:
    """The whole request body in one buffer, its size taken from `budget` (None: already
    taken); the caller gives `len(body)` back when the request ends, and a failure here
    gives back what it took.

    Refused with 413 as soon as it exceeds `limit`, with 503 when `budget` cannot hold it.
    A body of one message is that message's bytes; a longer one is copied once, into a
    buffer of its declared length (or one grown chunk by chunk when none was declared).
    """
    if declared is not None and declared > limit:
        raise RouterError(413, f"request body of {declared} bytes exceeds the {limit} byte limit")
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    first: bytes = message.get("body", b"")
    more = message.get("more_body", False)
    if len(first) > limit:
        raise RouterError(413, f"request body exceeds the {limit} byte limit")
    taken = 0 if budget is None else len(first) if declared is None or not more else declared
    if budget is not None:
        budget.take(taken)
    if not more:
        return first
    try:
        if declared is None:
            return await _read_growing(receive, bytearray(first), limit, budget)
        return await _read_declared(receive, first, declared)
    except BaseException:
        if budget is not None:
            budget.give_back(taken)
        raise


async def _next_chunk(receive: Receive) -> tuple[bytes, bool]:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    return message.get("body", b""), message.get("more_body", False)


async def _read_declared(receive: Receive, first: bytes, declared: int) -> bytearray:
    """The rest of a body of a declared length, copied in place into one buffer (the
    server frames the body by its Content-Length, so it never runs past it)."""
    body = bytearray(declared)
    body[:len(first)] = first
    size, more = len(first), True
    while more:
        chunk, more = await _next_chunk(receive)
        if size + len(chunk) > declared:
            raise RouterError(400, "request body is longer than its Content-Length")
        body[size:size + len(chunk)] = chunk
        size += len(chunk)
    if size != declared:
        raise RouterError(400, "request body is shorter than its Content-Length")
    return body


async def _read_growing(
    receive: Receive, body: bytearray, limit: int, budget: BodyBudget | None
) -> bytearray:
    """The rest of a body without a declared length; each chunk is taken from `budget` as
    it arrives (and given back here if the read fails)."""
    grown, more = 0, True
    try:
        while more:
            chunk, more = await _next_chunk(receive)
            if len(body) + len(chunk) > limit:
                raise RouterError(413, f"request body exceeds the {limit} byte limit")
            if budget is not None:
                budget.take(len(chunk))
                grown += len(chunk)
            body += chunk
        return body
    except BaseException:
        if budget is not None:
            budget.give_back(grown)
        raise


def with_first_fields(body: RequestBody, fields: bytes) -> bytes:
    """`body` (a JSON object, checked before routing) with `fields` (`"key":value`
    pairs, comma-separated) first, in one copy of the body. A key the client also set
    comes later in the body, and JSON parsers (SGLang's among them) keep the last."""
    brace = 0
    while brace < len(body) and body[brace] in _JSON_SPACE:  # no stripped copy of the body
        brace += 1
    after = brace + 1
    while after < len(body) and body[after] in _JSON_SPACE:
        after += 1
    separator = b"" if body[after:after + 1] == b"}" else b","
    return b"".join((b"{", fields, separator, memoryview(body)[brace + 1:]))


class _Peek(BaseModel):
    """The only two fields the router reads; everything else is skipped while parsing."""

    model_config = ConfigDict(extra="ignore")
    model: Any = None
    stream: Any = None


# SGLang's request models read `stream` as a lax pydantic bool ("true", "yes", "1", 1 all
# stream): the router reads it the same way, so both agree on whether a request streams.
_LAX_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def _streams(value: Any) -> bool:
    if value is True or value is False:  # JSON's own booleans, nearly every request
        return value
    try:
        return value is not None and _LAX_BOOL.validate_python(value)
    except ValidationError:
        return False  # the engine refuses the request with its own 400


def _peek(body: RequestBody) -> _Peek:
    if not body:
        raise RouterError(400, "request body is empty: expected a JSON object")
    try:
        return _Peek.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "model_type":
            raise RouterError(400, "request body must be a JSON object") from None
        raise RouterError(400, f"request body is not valid JSON: {_json_error(error)}"
                          ) from None


#: The parser's words for a \u escape of half a UTF-16 surrogate pair; its own message
#: ("unexpected end of hex escape") reads like a truncated body.
_SURROGATE_ERRORS = ("unexpected end of hex escape", "lone leading surrogate in hex escape")


def _json_error(error: ErrorDetails) -> str:
    message = str(error.get("ctx", {}).get("error", error["msg"]))
    for words in _SURROGATE_ERRORS:
        if message.startswith(words):
            where = message.removeprefix(words).strip()
            return (r"a \ud800-\udfff escape must be half of a surrogate pair (high, then "
                    f"low): a lone surrogate is no character ({where})")
    return str(error["msg"])


def request_info(
    kind: RouteKind, path: str, body: RequestBody, head: RequestHead,
    affinity: AffinitySettings | None = None,
) -> RequestInfo:
    """What routing sees of the request; a generation body that is not a JSON object is
    refused here with 400. With `affinity` (enabled), a generation also carries its
    prompt's block keys and the client's session key."""
    if kind is RouteKind.GENERATE:
        peek = _peek(body)
        model = peek.model if isinstance(peek.model, str) else None
        if affinity is None or not affinity.enabled:
            return RequestInfo(path, model, _streams(peek.stream), None, head.pool_header)
        return RequestInfo(
            path, model, _streams(peek.stream), None, head.pool_header,
            prefix=prefix_keys(body, affinity.block_bytes, affinity.bytes_per_token),
            session=session_key(head.session))
    pool: Pool | None = "baseline" if kind is RouteKind.OTHER_V1 else None
    return RequestInfo(path, None, False, pool, head.pool_header)
