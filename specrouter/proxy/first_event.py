"""The first event of a relayed stream, read before the client's response head leaves.

SGLang sends a stream's HTTP head only with its first output, so holding the client's
head until the first upstream chunk costs nothing: both leave together. It lets the proxy
read what SGLang says first. A full queue (`--max-queued-requests`) answers a stream
with HTTP 200 and one event carrying status 503, then `data: [DONE]`:
`data: {"error": {..., "code": 503}}` on the OpenAI routes, an output whose
`meta_info.finish_reason` is `{"type": "abort", "status_code": 503, ...}` on `/generate`
(SGLang 0.5.23 `serving_chat.py:2568-2580`, `tokenizer_manager.py:1891-1922`,
`entrypoints/http_server.py:956`). `event_status` finds that status, so such a
stream is retried elsewhere like an HTTP 503.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

# An error event is a few hundred bytes; a first chunk that opens one but has not ended
# within this many bytes is relayed as it is.
MAX_FIRST_EVENT = 64 * 1024
_ERROR_OPENINGS = (b'data: {"error"', b'data:{"error"')


async def first_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The stream's first non-empty bytes, None if it ended without any. When they open
    an error event, reading goes on until that event is whole (or MAX_FIRST_EVENT)."""
    first = b""
    async for chunk in chunks:
        if not chunk:
            continue
        first += chunk
        if first_event_complete(first):
            return first
    return first or None


def first_event_complete(first: bytes) -> bool:
    """Whether the stream's first bytes `first` are enough to relay: an ordinary first
    output, or a whole error event (or MAX_FIRST_EVENT bytes of one)."""
    return not _opens_error(first) or b"\n\n" in first or len(first) >= MAX_FIRST_EVENT


def _opens_error(data: bytes) -> bool:
    head = data.lstrip()[:len(_ERROR_OPENINGS[0])]
    return any(opening.startswith(head) or head.startswith(opening)
               for opening in _ERROR_OPENINGS)


def event_status(first: bytes) -> int | None:
    """The HTTP status the stream's first event stands for, if it is an error or an
    abort with a status; None for an ordinary first event."""
    if b'"error"' not in first and b'"abort"' not in first:
        return None  # an ordinary first output: no parse
    line = first.lstrip().split(b"\n", 1)[0]
    if not line.startswith(b"data:"):
        return None
    try:
        event: Any = json.loads(line[5:])
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    error = event.get("error")
    if isinstance(error, dict):
        return _status(error.get("code"))
    meta = event.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return _status(finish.get("status_code"))
    return None


def _status(value: Any) -> int | None:
    return value if isinstance(value, int) and 400 <= value < 600 else None
