"""The usage event the proxy asks for itself is left out of the client's stream, however
the engine's bytes are split into reads, and nothing else is changed or delayed past its
event's end."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrouter.proxy.usage import asks_usage, held_at_end, strip_usage


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return _sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = _sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
              "choices": [], "usage": {"prompt_tokens": 9000, "completion_tokens": 3,
                                       "prompt_tokens_details": {"cached_tokens": 8960}}})
DONE = b"data: [DONE]\n\n"
# generated text that spells the usage event's marker is escaped in the JSON
TRICKY = _chunk({"content": 'a "choices":[] b'})
WITHOUT = (_chunk({"role": "assistant", "content": ""}) + _chunk({"content": "Hi"})
           + TRICKY + _chunk({}, "stop"))
STREAM = WITHOUT + USAGE + DONE


def _through(reads: list[bytes]) -> tuple[bytes, list[bytes]]:
    """The client's bytes for the engine's `reads`, and what it had after each read."""
    held, out, after = b"", b"", []
    for data in reads:
        part, held = strip_usage(held, data)
        out += part
        after.append(out)
    return out + held_at_end(held), after


def _cuts(data: bytes, at: list[int]) -> list[bytes]:
    points = [0, *sorted(set(at)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def test_every_read_split_at_one_point_or_around_one_byte() -> None:
    for a in range(1, len(STREAM)):
        _check_split([a])
        _check_split([a, a + 1])


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
@settings(max_examples=300, deadline=None)
def test_the_client_gets_the_stream_without_the_usage_event_however_it_is_split(
        at: list[int]) -> None:
    _check_split(at)


def _check_split(at: list[int]) -> None:
    """The client's bytes for STREAM cut at `at`: no usage event, nothing else changed,
    and after every read each event whose end has arrived."""
    reads = _cuts(STREAM, at)
    out, after = _through(reads)
    assert out == WITHOUT + DONE
    received = b""
    for data, sent in zip(reads, after, strict=True):
        received += data
        # every event whose end has arrived has reached the client, the usage event aside
        whole = received[:received.rfind(b"\n\n") + 2] if b"\n\n" in received else b""
        assert sent.startswith(whole.replace(USAGE, b"")), (reads, sent)
        assert (WITHOUT + DONE).startswith(sent), (reads, sent)


def test_a_stream_without_a_usage_event_passes_read_for_read() -> None:
    second = WITHOUT.index(b"data: ", 1)
    split = WITHOUT.index(b'"choices":[{', second) + 14  # inside the second event's choice
    out, held = strip_usage(b"", WITHOUT[:split])
    assert (out, held) == (WITHOUT[:split], b"")  # its choices are in: not held
    out, held = strip_usage(held, WITHOUT[split:] + DONE)
    assert (out, held) == (WITHOUT[split:] + DONE, b"")


def test_a_stream_cut_inside_its_usage_event_ends_without_it() -> None:
    cut = USAGE.index(b'"choices":[]') + 20
    out, held = strip_usage(b"", WITHOUT + USAGE[:cut])
    assert out == WITHOUT and held_at_end(held) == b""
    # its boundary split across reads: the bytes ending the event before it still go out
    out, held = strip_usage(b"", WITHOUT[:-1])
    assert out == WITHOUT[:-1] and held == b""
    out, held = strip_usage(held, WITHOUT[-1:] + USAGE[:cut])
    assert out == b"\n" and held_at_end(held) == b""
    # nor is that boundary's end held back when the read ends with it
    assert strip_usage(b"", WITHOUT[-1:]) == (b"\n", b"")


def test_an_error_event_is_held_only_until_its_end() -> None:
    error = _sse({"error": {"message": "queue full", "code": 503}})
    out, held = strip_usage(b"", error[:12])
    assert (out, held) == (b"", error[:12])
    out, held = strip_usage(held, error[12:])
    assert (out, held) == (error, b"")
    assert held_at_end(error[:12]) == error[:12]  # a broken stream's last bytes still go out


@pytest.mark.parametrize(("path", "stream", "body", "asked"), [
    ("/v1/chat/completions", True, b'{"model":"m","stream":true}', True),
    ("/v1/completions", True, b'{"prompt":"p","stream":true}', True),
    ("/v1/chat/completions", False, b'{"model":"m"}', False),
    ("/generate", True, b'{"text":"t","stream":true}', False),
    ("/v1/chat/completions", True,
     b'{"stream":true,"stream_options":{"include_usage":false}}', False),
    ("/v1/chat/completions", True, b'{"stream":true,"stream_options":null}', False),
    # the key's bytes as a whole string value: left alone (no usage asked, none stripped)
    ("/v1/chat/completions", True, b'{"stream":true,"user":"stream_options"}', False),
    # the key's name inside text is escaped, so the request is asked for
    ("/v1/chat/completions", True,
     b'{"stream":true,"messages":[{"content":"set \\"stream_options\\""}]}', True),
])
def test_asks_usage(path: str, stream: bool, body: bytes, asked: bool) -> None:
    assert asks_usage(path, stream, body) is asked
