"""What the proxy sends back: the backend's headers filtered and ours added, the JSON
answers it makes itself, and the error event that ends a broken stream."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from starlette.types import Send

from specrouter.errors import JSON_HEADERS, sse_error_event
from specrouter.proxy.request import HOP_BY_HOP, POOL_HEADER, REQUEST_ID
from specrouter.proxy.upstream import (
    ChunkWriter,
    RawHeaders,
    UpstreamOverLimit,
    UpstreamResponse,
)
from specrouter.proxy.usage import held_at_end, strip_usage
from specrouter.routing.router import Target

log = logging.getLogger("specrouter.proxy")

# Our server writes its own date and server lines; content-length is always ours.
_NOT_RELAYED = HOP_BY_HOP | {b"date", b"server", b"content-length", REQUEST_ID}
# The router's own headers (`target_headers`) are set by the router alone: a backend's
# would reach the client and the router's metrics as if the router had said them.
_OURS = b"x-specrouter-"
# bytes of a stream kept to check that it ended with `data: [DONE]` and to read the
# engine's report of cached and output tokens in its last usage event (`reported_cache`,
# `reported_completion_tokens`)
STREAM_TAIL = 1024
#: The scope extension under which a server offers a `ChunkWriter` to the client's
#: connection: it writes one chunk of the chunked response the app already started, or
#: refuses (returns False) whenever the app's `send` would have to wait or would drop it.
CHUNK_WRITER = "specrouter.chunk_writer"
#: The scope extension under which a server offers a `DisconnectWatch`: `watch(callback)`
#: arms `callback`, called once from the event loop if the client leaves before the
#: response completed (soon, if it already left); `watch(None)` disarms it.
DISCONNECT_WATCH = "specrouter.disconnect_watch"
DisconnectWatch = Callable[[Callable[[], None] | None], None]


def target_headers(target: Target, request_id: bytes) -> RawHeaders:
    return [
        (POOL_HEADER, target.pool.encode()),
        (b"x-specrouter-backend", target.backend.name.encode()),
        (b"x-specrouter-reason", target.reason.encode()),
        (REQUEST_ID, request_id),
    ]


def response_headers(
    upstream: RawHeaders, target: Target, request_id: bytes, content_length: int | None = None
) -> RawHeaders:
    """Upstream headers minus hop-by-hop ones (the fixed list and those its `connection`
    header names) and minus any `x-specrouter-*`, plus ours: `content_length` for a
    buffered body, none (chunked) for a stream, which may gain an error event the upstream
    never sent."""
    named = _connection_tokens(upstream)
    headers: RawHeaders = []
    for key, value in upstream:
        lower = key.lower()
        if lower not in _NOT_RELAYED and lower not in named and not lower.startswith(_OURS):
            headers.append((lower, value))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    headers.extend(target_headers(target, request_id))
    return headers


def _connection_tokens(headers: RawHeaders) -> frozenset[bytes]:
    tokens: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    return frozenset(tokens)


async def read_whole(response: UpstreamResponse, limit: int) -> bytes:
    """A buffered answer's whole body; UpstreamOverLimit as soon as it passes `limit`
    bytes (from its Content-Length before reading, else while reading), so an endless
    or huge body costs at most `limit` bytes."""
    over = declared_over_limit(response.headers, limit)
    if over is not None:
        raise over
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.iter_raw():
        size += len(chunk)
        if size > limit:
            raise UpstreamOverLimit(f"response body exceeds the router's {limit} byte limit")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def declared_over_limit(headers: RawHeaders, limit: int) -> UpstreamOverLimit | None:
    """The error for an answer whose Content-Length says it passes `limit` bytes."""
    declared = _content_length(headers)
    if declared is None or declared <= limit:
        return None
    return UpstreamOverLimit(f"response body of {declared} bytes exceeds the router's "
                             f"{limit} byte limit")


def _content_length(headers: RawHeaders) -> int | None:
    for key, value in headers:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def is_event_stream(headers: RawHeaders) -> bool:
    for key, value in headers:
        if key.lower() == b"content-type":
            return value.lower().startswith(b"text/event-stream")
    return False


async def send_json(
    send: Send, status: int, body: bytes, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def keep_tail(tail: bytes, chunk: bytes) -> bytes:
    """The last STREAM_TAIL bytes of the stream after `chunk`."""
    return chunk[-STREAM_TAIL:] if len(chunk) >= STREAM_TAIL else (tail + chunk)[-STREAM_TAIL:]


class StreamRelay:
    """What a stream sent: `tail` of its bytes (with a `record_limit`, all of them in
    `record` for a handover to read, until they pass that many bytes: a stream that long
    is past any handover budget), and `write`, the client's chunk writer keeping that
    tail, for an upstream to divert body bytes to. While `holding`, `write` refuses every
    chunk, so they reach the relay's own loop, which decides on a handover.

    With `without_usage` the client gets the stream without its usage event, which the
    proxy asked for itself (`proxy/usage.py`): `write` and `for_client` leave it out,
    `rest_for_client` gives what was held back when the stream ends. `tail` and `record`
    keep the engine's bytes, usage included."""

    __slots__ = ("_client", "_held", "_room", "holding", "record", "tail")

    def __init__(self, client: ChunkWriter | None, record_limit: int = 0,
                 tail: bytes = b"", without_usage: bool = False) -> None:
        self._client = client
        self.tail = tail
        self.record: list[bytes] | None = [] if record_limit > 0 else None
        self._room = record_limit
        self.holding = False
        # bytes held back from the client (None: the usage event is not stripped)
        self._held: bytes | None = b"" if without_usage else None

    def sent(self, chunk: bytes) -> None:
        # keep_tail, inline: once per chunk of every stream
        self.tail = (chunk[-STREAM_TAIL:] if len(chunk) >= STREAM_TAIL
                     else (self.tail + chunk)[-STREAM_TAIL:])
        if self.record is not None:
            self._room -= len(chunk)
            if self._room >= 0:
                self.record.append(chunk)
            else:
                self.record = None

    def write(self, chunk: bytes) -> bool:
        if self.holding or self._client is None:
            return False
        if self._held is None:
            if not self._client(chunk):
                return False
        else:
            out, held = strip_usage(self._held, chunk)
            if not self._client(out):
                return False  # the chunk comes back through the relay's loop, held unchanged
            self._held = held
        self.sent(chunk)
        return True

    def for_client(self, chunk: bytes) -> bytes:
        """What the client gets now of the stream's next bytes `chunk`."""
        if self._held is None:
            return chunk
        out, self._held = strip_usage(self._held, chunk)
        return out

    def rest_for_client(self) -> bytes:
        """What the client still gets of the bytes held back, as the stream ends."""
        if not self._held:
            return b""
        rest, self._held = held_at_end(self._held), b""
        return rest

    def hold(self) -> None:
        self.holding = True

    @property
    def at_boundary(self) -> bool:
        """Whether the bytes sent end between two events."""
        return self.tail.endswith(b"\n\n")


_CACHED_KEY = b'"cached_tokens":'
_PROMPT_KEY = b'"prompt_tokens":'
_COMPLETION_KEY = b'"completion_tokens":'


def _int_after(data: bytes, key: bytes) -> int | None:
    at = data.rfind(key)
    if at < 0:
        return None
    start = at + len(key)
    while start < len(data) and data[start] in b" \t":
        start += 1
    end = start
    while end < len(data) and 48 <= data[end] <= 57:
        end += 1
    return int(data[start:end]) if end > start else None


def reported_cache(data: bytes) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from the last usage SGLang wrote in `data` (a
    stream's tail or a whole answer): `usage.prompt_tokens` with
    `prompt_tokens_details.cached_tokens` (`--enable-cache-report`), or /generate's
    `meta_info`. A key inside generated text is escaped (`\\"`), so it never matches.
    None when either is missing."""
    cached = _int_after(data, _CACHED_KEY)
    if cached is None:
        return None
    prompt = _int_after(data, _PROMPT_KEY)
    return None if prompt is None else (prompt, cached)


def reported_completion_tokens(data: bytes) -> int | None:
    """The output tokens of the last usage SGLang wrote in `data`: `usage.completion_tokens`
    (`meta_info` on /generate). None when missing."""
    return _int_after(data, _COMPLETION_KEY)


def ended_with_done(tail: bytes) -> bool:
    return tail.rstrip().endswith(b"data: [DONE]")


def stream_error_trailer(target: Target, tail: bytes, message: str, code: int) -> bytes:
    """The error event that ends a broken stream, after what the client already got."""
    name = target.backend.name
    log.warning("stream from %s broke: %s", name, message)
    event = sse_error_event(f"{message} (backend {name})", code=code)
    # A cut inside an event would glue our event onto it; end that line first.
    at_boundary = not tail or tail.endswith((b"\n\n", b"\r\n\r\n"))
    return event if at_boundary else b"\n\n" + event
