"""The edge's safety items, probed over raw sockets against any running router.

Each probe answers what a client sees, so uvicorn with `specrouter.edge.guard` and another
ASGI server (granian) are judged by the same bytes:

- `oversized_head`: a request head of `head_bytes` (one long header): the status line of
  the answer, or "closed" when the server drops the connection without one.
- `oversized_body`: a POST whose content-length is one byte over the router's body limit.
- `slowloris`: a request head sent one byte every `interval_s`: seconds until the server
  closes the connection, or None when it still holds it after `give_up_s`.
- `drain`: SIGTERM to the server while a stream is in flight: whether that stream ends
  complete (`data: [DONE]`), what a new request gets meanwhile, and seconds to exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any
from urllib.parse import urlsplit

import psutil


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


async def _status_line(url: str, request: bytes, timeout: float = 10.0) -> str:
    """The first line of the answer to `request`, or "closed"/"refused"/"timeout"."""
    try:
        reader, writer = await asyncio.open_connection(*_address(url))
    except OSError:
        return "refused"
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return line.decode(errors="replace").strip() or "closed"
    except TimeoutError:
        return "timeout"
    except OSError:
        return "closed"
    finally:
        writer.close()


async def oversized_head(url: str, head_bytes: int = 128 * 1024) -> str:
    filler = b"a" * head_bytes
    return await _status_line(url, b"GET /health HTTP/1.1\r\nhost: x\r\nx-filler: " + filler
                              + b"\r\n\r\n")


async def oversized_body(url: str, model: str, max_body_bytes: int) -> str:
    size = max_body_bytes + 1
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            f"\r\ncontent-length: {size}\r\n\r\n").encode()
    return await _status_line(url, head + b" " * size)


async def slowloris(url: str, interval_s: float = 0.5, give_up_s: float = 20.0
                    ) -> float | None:
    reader, writer = await asyncio.open_connection(*_address(url))
    head = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-slow: " + b"s" * 10_000
    start = time.perf_counter()
    try:
        for byte in head:
            if time.perf_counter() - start > give_up_s:
                return None
            writer.write(bytes([byte]))
            await writer.drain()
            try:  # the server closing the connection ends the read with b""
                if await asyncio.wait_for(reader.read(1024), interval_s) == b"":
                    return time.perf_counter() - start
            except TimeoutError:
                continue
            return time.perf_counter() - start  # answered (e.g. 408/400) before the head
    except OSError:
        return time.perf_counter() - start
    finally:
        writer.close()
    return None


async def _stream(url: str, model: str, max_tokens: int, started: asyncio.Event
                  ) -> dict[str, Any]:
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    reader, writer = await asyncio.open_connection(*_address(url))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                 % len(body) + body)
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
            if b"data:" in data:
                started.set()
    except OSError:
        pass
    finally:
        started.set()
        writer.close()
    return {"complete": b"data: [DONE]" in data, "events": data.count(b"data:")}


async def drain(url: str, model: str, pid: int, max_tokens: int = 400) -> dict[str, Any]:
    """SIGTERM to `pid` once a stream of `max_tokens` is under way."""
    started = asyncio.Event()
    stream = asyncio.ensure_future(_stream(url, model, max_tokens, started))
    await started.wait()
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGTERM)
    await asyncio.sleep(0.3)
    during = await _status_line(url, b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n", 5.0)
    in_flight = await stream
    exited_s: float | None = None
    try:
        await asyncio.to_thread(psutil.Process(pid).wait, 60)
        exited_s = time.perf_counter() - t0
    except psutil.TimeoutExpired:
        pass
    except psutil.NoSuchProcess:
        exited_s = time.perf_counter() - t0
    return {"in_flight_stream": in_flight, "ready_during_drain": during,
            "stream_s_after_sigterm": round(time.perf_counter() - t0, 2),
            "exit_s_after_sigterm": None if exited_s is None else round(exited_s, 2)}
