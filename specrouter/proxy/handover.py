"""Handover: a stream that already answered continues on another backend.

A recall (`proxy/recall.py`) moves a stream only before its first byte. Past it, when
the stream's group switches pools (to the baseline under load, back to EAGLE-3 when
the load is gone), the stream is handed over: the proxy stops relaying at an event
boundary, leaves the attempt (it is aborted by its rid), and sends a continuation of
the request to the backend the router chooses next: the chat messages plus the
assistant message streamed so far, with SGLang's `continue_final_message` (0.5.23
`serving_chat.py` `_handle_last_assistant_message`: the assistant text continues the
prompt after the generation prompt), or for `/v1/completions` the prompt plus the text
so far; the output budget less the tokens already sent. The continuation's events reach
the client restamped with the first stream's id, created time and model, its role chunk
dropped, so the client reads one stream with one id.

What the first stream sent is read only at the handover (the relay records the bytes
of a stream that may be handed over), so a stream that is never handed over pays a
list append per write and no parse.

Which requests can be handed over (`continuable`): a streamed, single-choice chat or
completion with a text prompt and no output constraint that a continuation could not
carry on from the middle: no tools, no response format or grammar, no stop strings (one
could straddle the cut), no logprobs, no client rid. A stream that already sent a
finish reason, an error, a tool call or reasoning text stays where it is.

Tokens sent so far are estimated as content events x the engine's accept length (an
EAGLE-3 event carries one verify step's accepted tokens, a baseline event one token);
the continuation's `max_tokens` and the usage the client gets rest on that estimate. A
stream that has spent half its output budget or more stays where it is: it may end
soon, so moving it would spend a prefill on little, and the switch's handover budget
(shared by the group's streams, first come first served) is left to the streams with
more of their answer ahead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from specrouter.proxy.upstream import RequestBody

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Keys whose presence (with a value other than the listed harmless one) rules a
# continuation out: the continuation cannot resume their state from the middle.
_BLOCKING: dict[str, object] = {
    "tools": None, "functions": None, "tool_choice": "none", "response_format": None,
    "regex": None, "ebnf": None, "json_schema": None, "structural_tag": None,
    "logprobs": False, "top_logprobs": None, "stop": None, "stop_token_ids": None,
    "stop_regex": None, "continue_final_message": False, "echo": False, "suffix": None,
    "min_tokens": 0, "rid": None, "return_hidden_states": False,
}
# SGLang's CompletionRequest default output budget when the client sets none.
_COMPLETION_DEFAULT_MAX = 16


@dataclass(frozen=True, slots=True)
class Sent:
    """What the first stream gave the client: its stamp and the text so far."""

    id: str
    created: int
    model: str
    text: str
    events: int  # content events


@dataclass(frozen=True, slots=True)
class Continuation:
    """A handed-over request: the body to send next and how to restamp its events."""

    body: bytes
    sent: Sent
    tokens_sent: int
    chat: bool


def continuable(path: str, body: dict[str, Any]) -> bool:
    """Whether a continuation can carry this request on from the middle of its answer."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH) or body.get("stream") is not True:
        return False
    if body.get("n") not in (None, 1):
        return False
    if any(_blocks(key, body.get(key), harmless) for key, harmless in _BLOCKING.items()):
        return False
    if path == CHAT_PATH:
        messages = body.get("messages")
        return (isinstance(messages, list) and bool(messages)
                and isinstance(messages[-1], dict) and messages[-1].get("role") != "assistant")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return isinstance(prompt, str)


def _blocks(key: str, value: object, harmless: object) -> bool:
    if value is None or value == harmless or value == [] or value == "":
        return False
    return not (key == "response_format" and isinstance(value, dict)
                and value.get("type") == "text")


def events(data: bytes) -> Iterator[bytes]:
    """The payloads of the complete `data:` events in `data` (an SSE byte stream)."""
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                yield line[5:].strip()


def read_sent(data: bytes, chat: bool) -> Sent | None:
    """What the client got, from the bytes relayed so far (ending on an event boundary);
    None when the stream cannot be continued: it finished, failed, or sent something
    other than plain text (tool calls, reasoning)."""
    stamp: dict[str, Any] | None = None
    text: list[str] = []
    count = 0
    for payload in events(data):
        if payload == b"[DONE]":
            return None
        try:
            event = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(event, dict) or "error" in event:
            return None
        stamp = stamp or event
        piece = _piece(event, chat)
        if piece is None:
            return None
        if piece:
            text.append(piece)
            count += 1
    if stamp is None:
        return None
    return Sent(str(stamp.get("id", "")), int(stamp.get("created") or 0),
                str(stamp.get("model", "")), "".join(text), count)


def _piece(event: dict[str, Any], chat: bool) -> str | None:
    """An event's text; None when it ends the answer or carries more than text."""
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) > 1:
        return None
    if not choices:
        return ""  # a usage event
    choice = choices[0]
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return None
    if not chat:
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return None
    for key, value in delta.items():
        if key not in ("role", "content") and value not in (None, "", []):
            return None
    content = delta.get("content")
    return content if isinstance(content, str) else ""


def tokens_sent(sent: Sent, accept_length: float | None) -> int:
    """Output tokens the client got: content events x the engine's accept length (at
    least one token per event)."""
    per_event = max(1.0, accept_length or 1.0)
    return math.ceil(sent.events * per_event) if sent.events else 0


def continuation(path: str, body: dict[str, Any], sent: Sent,
                 accept_length: float | None) -> Continuation | None:
    """The request that carries the answer on from `sent`; None when half its output
    budget or more is spent (the first stream is about to end anyway)."""
    chat = path == CHAT_PATH
    spent = tokens_sent(sent, accept_length)
    out = dict(body)
    budget_keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    budget_key = next((k for k in budget_keys if body.get(k) is not None), None)
    limit = (body[budget_key] if budget_key is not None
             else None if chat else _COMPLETION_DEFAULT_MAX)
    if isinstance(limit, int):
        if 2 * spent >= limit:
            return None
        out[budget_key or "max_tokens"] = limit - spent
    if chat:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": sent.text}]
        out["continue_final_message"] = True
    else:
        prompt = body["prompt"]
        out["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + sent.text
    encoded = json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode()
    return Continuation(encoded, sent, spent, chat)


def parse_body(body: RequestBody) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Restamp:
    """Rewrites a continuation's SSE bytes for the client: every event carries the
    first stream's id, created and model; the continuation's role chunk is dropped (the
    client had one); usage counts the tokens of both streams (prompt tokens less the
    ones sent, completion tokens plus them). Events are passed whole: bytes of an
    unfinished event wait for the rest."""

    def __init__(self, handed: Continuation) -> None:
        self._handed = handed
        self._pending = b""
        self._first = True

    def feed(self, data: bytes) -> bytes:
        buffer = (self._pending + data).replace(b"\r\n", b"\n")
        *whole, self._pending = buffer.split(b"\n\n")
        return b"".join(self._event(block) for block in whole)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._event(rest) if rest.strip() else b""

    def _event(self, block: bytes) -> bytes:
        payload = next(events(block + b"\n\n"), None)
        if payload is None or payload == b"[DONE]":
            return block + b"\n\n"
        try:
            event = json.loads(payload)
        except ValueError:
            return block + b"\n\n"
        if not isinstance(event, dict) or "error" in event:
            return block + b"\n\n"
        if self._first and self._handed.chat and _is_role_chunk(event):
            self._first = False
            return b""
        self._first = False
        sent = self._handed.sent
        event.update(id=sent.id, created=sent.created, model=sent.model)
        usage = event.get("usage")
        if isinstance(usage, dict):
            spent = self._handed.tokens_sent
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                usage["prompt_tokens"] = max(0, prompt - spent)
                usage["completion_tokens"] = completion + spent
        encoded = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
        return b"data: " + encoded + b"\n\n"


def _is_role_chunk(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return (isinstance(delta, dict) and delta.get("role") == "assistant"
            and not delta.get("content") and choices[0].get("finish_reason") is None)


def boundary(data: bytes) -> int:
    """The length of `data` up to and including its first event boundary; 0 when none."""
    cut = data.find(b"\n\n")
    return 0 if cut < 0 else cut + 2
