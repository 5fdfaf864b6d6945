"""One streamed request, measured from the raw SSE bytes, on a minimal HTTP/1.1 client.

The load generator shares 2 cores with the simulator and the router it measures, so its
own CPU per request must be small. Measured with `python -m loadtest.client_cost` (256
requests of 256 streamed tokens at concurrency 64): this client 6.2 ms CPU per request
(0.18 cores), httpx streaming 18.9 ms (0.53 cores), the `openai` SDK 35.4 ms (0.96
cores, a whole core at the sweep's top level). So this module speaks HTTP/1.1 itself
on asyncio streams: keep-alive connections in a LIFO pool (O(1) acquire/release),
chunked or sized bodies, SSE events split by hand and timestamped as their bytes arrive.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from loadtest.metrics import RequestResult

#: Each request's id, which a router forwards to its backend (SGLang logs it).
REQUEST_ID = "x-request-id"

_DONE = b"[DONE]"


def endpoint_path(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class HTTPProtocolError(Exception):
    """The server's bytes are not the HTTP/1.1 this client understands."""


class Connection:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.reusable = True

    def close(self) -> None:
        self.reusable = False
        self.writer.close()

    async def post(self, head: bytes, body: bytes) -> tuple[int, dict[str, str]]:
        """Send the request; return status and lower-cased headers."""
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise HTTPProtocolError(f"bad status line {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        if headers.get("connection", "").lower() == "close":
            self.reusable = False
        return int(parts[1]), headers

    async def body_chunks(self, headers: dict[str, str]) -> Any:
        """The body as it arrives: chunked, sized, or until the server closes."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self.reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while (await self.reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            remaining = int(headers["content-length"])
            while remaining > 0:
                data = await self.reader.read(min(remaining, 65536))
                if not data:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(data)
                yield data
        else:
            self.reusable = False
            while data := await self.reader.read(65536):
                yield data


class ConnectionPool:
    """Idle keep-alive connections to one origin, handed out last-in first-out."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self._idle: list[Connection] = []

    async def acquire(self) -> Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof():
                return conn
            conn.close()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20), 30.0)
        return Connection(reader, writer)

    def release(self, conn: Connection) -> None:
        if conn.reusable:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def request_head(self, path: str, body_len: int, headers: dict[str, str]) -> bytes:
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"host: {self.host}:{self.port}",
                 "content-type: application/json", f"content-length: {body_len}",
                 "accept: text/event-stream"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Stream:
    """Accumulates the SSE events of one response into a RequestResult."""

    def __init__(self, result: RequestResult, t0: float,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.result = result
        self.t0 = t0
        self.on_event = on_event
        self.last_chunk: float | None = None
        self.usage_tokens: int | None = None
        self.done = False
        self.buffer = b""

    def feed(self, data: bytes, now: float) -> None:
        self.buffer += data
        while True:
            cut = self.buffer.find(b"\n\n")
            if cut < 0:
                return
            event, self.buffer = self.buffer[:cut], self.buffer[cut + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.event(line[5:].strip(), now)

    def event(self, data: bytes, now: float) -> None:
        if data == _DONE:
            self.done = True
            return
        try:
            payload: dict[str, Any] = json.loads(data)
        except ValueError:
            self.result.error = "bad SSE JSON"
            return
        if self.on_event is not None:
            self.on_event(payload)
        if "error" in payload:
            err = payload["error"]
            self.result.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        usage = payload.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
            self.result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        if _has_content(payload):
            self.content(now)

    def content(self, now: float) -> None:
        r = self.result
        if self.last_chunk is None:
            r.ttft = now - self.t0
        else:
            r.itl.append(now - self.last_chunk)
        self.last_chunk = now
        r.chunks += 1


def _has_content(payload: dict[str, Any]) -> bool:
    for choice in payload.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                return True
        elif choice.get("text"):
            return True
    return False


_NETWORK_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                   asyncio.TimeoutError, HTTPProtocolError, ValueError)


async def stream_request(pool: ConnectionPool, path: str, body: bytes, result: RequestResult,
                         headers: dict[str, str] | None = None,
                         on_event: Callable[[dict[str, Any]], None] | None = None,
                         ) -> RequestResult:
    """Send one streaming request and fill `result`; never raises on HTTP/IO errors.
    `on_event` sees every parsed SSE payload (e.g. to keep the answer's text)."""
    sent = {REQUEST_ID: result.request_id or uuid.uuid4().hex, **(headers or {})}
    result.request_id = sent[REQUEST_ID]
    head = pool.request_head(path, len(body), sent)
    t0 = result.sent_at = time.perf_counter()
    state = _Stream(result, t0, on_event)
    conn: Connection | None = None
    try:
        conn = await pool.acquire()
        result.status, response_headers = await asyncio.wait_for(
            conn.post(head, body), pool.timeout)
        result.ttfb = time.perf_counter() - t0
        result.pool = response_headers.get("x-specrouter-pool", "")
        result.backend = response_headers.get("x-specrouter-backend", "")
        result.reason = response_headers.get("x-specrouter-reason", "")
        if result.status != 200:
            text = b"".join([c async for c in conn.body_chunks(response_headers)])
            result.error = f"HTTP {result.status}: {text[:300].decode(errors='replace')}"
        else:
            async for data in conn.body_chunks(response_headers):
                state.feed(data, time.perf_counter())
    except _NETWORK_ERRORS as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
        if conn is not None:
            conn.close()
    except asyncio.CancelledError:
        if conn is not None:
            conn.close()
        raise
    if conn is not None:
        pool.release(conn)
    result.e2e = time.perf_counter() - t0
    result.output_tokens = state.usage_tokens if state.usage_tokens is not None else result.chunks
    if not result.error and not state.done:
        result.error = "stream ended without [DONE]"
    if not result.error and result.ttft is None:
        result.error = "no content"
    result.ok = not result.error
    return result
