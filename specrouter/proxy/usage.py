"""The engine's usage report on every stream, whether or not the client asked for it.

SGLang reports what it had cached of a prompt (`usage.prompt_tokens_details.cached_tokens`
with `--enable-cache-report`) in a stream only when the request sets
`stream_options.include_usage`: then, after the finish chunk, one more event carries the
usage and `"choices":[]` (serving_chat.py 0.5.23:2766-2805, serving_completions.py
likewise). The affinity's retention (`routing/affinity/retention.py`) rests on those
reports, so the proxy asks for the usage on every chat or completions stream that did
not set `stream_options` itself (`asks_usage`, `USAGE_FIELD`), and drops that event before
the client (`strip_usage`): what the client gets is what it would have got without the
router. A client that set `stream_options` (asking for usage or not) gets its stream as
the engine sends it.
"""

from __future__ import annotations

from specrouter.proxy.handover import CHAT_PATH, COMPLETIONS_PATH
from specrouter.proxy.upstream import RequestBody

#: The field that asks SGLang for a stream's usage event.
USAGE_FIELD = b'"stream_options":{"include_usage":true}'
#: Only the usage event has no choice. JSON escapes a quote inside a string, so generated
#: text never contains these bytes.
_NO_CHOICE = b'"choices":[]'
_A_CHOICE = b'"choices":[{'
_BOUNDARY = b"\n\n"
_FIELD = b"data: "


def asks_usage(path: str, stream: bool, body: RequestBody) -> bool:
    """Whether the proxy asks for this request's usage event: a chat or completions stream
    whose body has no `stream_options` key. The bytes `"stream_options"` occur only as a
    key or a whole string value; the rare value is a false positive that just leaves the
    body alone."""
    return stream and path in (CHAT_PATH, COMPLETIONS_PATH) and b'"stream_options"' not in body


def strip_usage(held: bytes, data: bytes) -> tuple[bytes, bytes]:
    """The bytes of a stream for the client, the usage event left out, and the bytes held
    back: an unfinished last event that may yet turn out to be the usage event (its
    choices not received yet, or it is the usage event and its end is not). `held` is
    what the previous call held back. A normal event is never held once its first choice
    is in, nor a finished one's boundary, so holding delays only an event whose first
    bytes the engine's write split."""
    if held:
        data = held + data
    if data.endswith(_BOUNDARY) and _NO_CHOICE not in data:
        return data, b""
    cut = data.rfind(_BOUNDARY)
    cut = 0 if cut < 0 else cut + len(_BOUNDARY)
    rest = data[cut:]
    cut += len(rest) - len(rest.lstrip(b"\n"))  # the end of a boundary split by the read
    rest = data[cut:]
    if not rest or _A_CHOICE in rest:
        return _without_usage(data), b""
    return _without_usage(data[:cut]), rest


def held_at_end(held: bytes) -> bytes:
    """What of the bytes held back (an unfinished event) the client gets when the stream
    ends with them: all of them but the usage event's."""
    return held[:_event_start(held, held.find(_NO_CHOICE))] if _NO_CHOICE in held else held


def _without_usage(data: bytes) -> bytes:
    """`data` without its whole usage events (an event runs from its `data: ` to its
    boundary; the bytes before its start may end the previous event's boundary)."""
    at = data.find(_NO_CHOICE)
    while at >= 0:
        start, end = _event_start(data, at), data.find(_BOUNDARY, at)
        if end < 0:
            break
        data = data[:start] + data[end + len(_BOUNDARY):]
        at = data.find(_NO_CHOICE, start)
    return data


def _event_start(data: bytes, at: int) -> int:
    """Where the event holding position `at` starts."""
    return max(0, data.rfind(_FIELD, 0, at))
