"""Handover: a started stream continued on the group's other pool as one stream.

The proxy's cycle in process against scripted backends (`test_forward`'s harness): the
first backend streams event by event behind a gate, the test sets the router's recall
event mid-stream (the group switched), and the client's bytes are read back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from specrouter.proxy.handover import (
    Restamp,
    continuable,
    continuation,
    read_sent,
)
from specrouter.proxy.response import StreamRelay
from specrouter.proxy.upstream import RawHeaders, UpstreamResponse
from specrouter.routing.router import HandoverBudget
from tests.fixtures.fake_router import BACKENDS, ListRouter
from tests.proxy.test_forward import (
    DONE,
    JSON,
    SSE,
    STREAM_CHAT,
    Backend_,
    Exchange,
    Scripted,
    make_app,
    run,
)

CHAT = "/v1/chat/completions"
# A client that set `stream_options` itself: the proxy asks for no usage event and strips
# none, so each upstream read reaches the client as it comes, an event's first part too
# (`_switch_mid_stream` counts them). One test below streams with the default request.
PLAIN = {**STREAM_CHAT, "stream_options": {"include_usage": False}}


def _event(content: str | None = None, *, role: bool = False, finish: str | None = None,
           stamp: str = "e") -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    chunk = {"id": stamp, "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _usage(prompt: int, completion: int) -> bytes:
    chunk = {"id": "b", "object": "chat.completion.chunk", "created": 2, "model": "m",
             "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                      "total_tokens": prompt + completion}}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class Gated(Backend_):
    """Streams `chunks`, each released by one `gate` put (no gate: all at once)."""

    def __init__(self, chunks: Sequence[bytes], gate: asyncio.Queue[None] | None = None,
                 status: int = 200, headers: RawHeaders = SSE) -> None:
        super().__init__()
        self.chunks, self.gate, self.status, self.headers = chunks, gate, status, headers

    async def open(self, method: str, path: str, headers: RawHeaders, body: bytes, *,
                   stream: bool) -> UpstreamResponse:
        if path == "/abort_request":
            return await super().open(method, path, headers, body, stream=stream)
        self.requests.append((path, json.loads(body)))
        return Scripted(self.status, self.headers, self.chunks, self.gate)


# The second content event is cut across two upstream reads; the third is never sent.
FIRST = [_event(role=True) + _event("Hel"),
         _event("lo")[:30],
         _event("lo")[30:] + _event(" world"),
         _event(finish="length") + DONE]
CONTINUED = [_event(role=True, stamp="b") + _event(" there", stamp="b"),
             _event(finish="length", stamp="b") + _usage(20, 5) + DONE]


async def _switch_mid_stream(body: dict[str, Any], reads: int, budget: float = 1e6,
                             baseline: Gated | None = None, back: bool = False
                             ) -> tuple[Exchange, ListRouter, Gated, Gated]:
    """One request streamed from e0 (`FIRST`, one read per gate put): after `reads`
    reads reached the client the group switches (its handover budget `budget` context
    tokens), then the rest is released. The exchange, router, e0 and b0 when it ended.
    With `back` the roles swap: the stream starts on b0 and the group switches back to
    EAGLE-3 (e0 continues it)."""
    gate: asyncio.Queue[None] = asyncio.Queue()
    router = ListRouter(armed_recall=True, backends=BACKENDS[::-1] if back else BACKENDS)
    e0, b0 = Gated(FIRST, gate), baseline or Gated(CONTINUED)
    if back:
        e0, b0 = b0, e0
    exchange = Exchange(make_app(router, e0, b0), CHAT, body)
    task = asyncio.create_task(exchange.run())
    for _ in range(reads):
        gate.put_nowait(None)
    while len(exchange.sent) < reads + 1:  # the head and one body message per read
        await asyncio.sleep(0)
    router.recalls[0].budget = HandoverBudget(budget)
    router.recalls[0].set()
    for _ in range(len(FIRST) - reads):
        gate.put_nowait(None)
    await task
    return exchange, router, e0, b0


def _contents(raw: bytes) -> tuple[str, set[str], list[dict[str, Any]]]:
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n")
              if line.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in events if c.get("choices"))
    return text, {c["id"] for c in events if "id" in c}, events


def test_a_switch_mid_stream_continues_the_answer_on_the_baseline() -> None:
    async def scenario() -> None:
        body = {**STREAM_CHAT, "max_tokens": 100, "stream_options": {"include_usage": True}}
        exchange, router, e0, b0 = await _switch_mid_stream(body, 2)
        text, ids, events = _contents(exchange.content)
        assert text == "Hello there" and ids == {"e"}
        assert exchange.header[b"x-specrouter-backend"] == b"e0"
        assert [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]
                ] == [events[0]]
        # two content events at (unknown) accept length 1: 2 tokens sent before
        assert events[-1]["usage"] == {"prompt_tokens": 18, "completion_tokens": 7,
                                       "total_tokens": 25}
        assert exchange.content.endswith(DONE)
        (_, sent), = b0.requests
        assert sent["messages"][-1] == {"role": "assistant", "content": "Hello"}
        assert sent["continue_final_message"] is True and sent["max_tokens"] == 98
        while not e0.aborts:
            await asyncio.sleep(0)
        assert e0.aborts == [{"rid": e0.requests[0][1]["rid"]}]
        # the continuation's usage counts its own tokens, the time runs from e0's first
        # chunk: neither engine's pace is read from it
        assert router.paces == []
        while router.held != {"e0": 0, "b0": 0}:
            await router.released.wait()
            router.released.clear()

    run(scenario())


def test_a_handed_over_stream_asks_both_engines_for_usage_and_the_client_gets_none() -> None:
    async def scenario() -> None:
        exchange, _, e0, b0 = await _switch_mid_stream({**STREAM_CHAT, "max_tokens": 100}, 1)
        text, ids, events = _contents(exchange.content)
        assert text == "Hel there" and ids == {"e"}
        assert all(e["choices"] for e in events), events  # the usage event left out
        assert exchange.content.endswith(DONE)
        for engine in (e0, b0):
            (_, sent), = engine.requests
            assert sent["stream_options"] == {"include_usage": True}

    run(scenario())


def test_a_switch_back_to_eagle_continues_a_baseline_stream_there() -> None:
    async def scenario() -> None:
        body = {**PLAIN, "max_tokens": 100}
        exchange, _, e0, b0 = await _switch_mid_stream(body, 2, back=True)
        text, ids, _ = _contents(exchange.content)
        assert text == "Hello there" and ids == {"e"}
        assert exchange.header[b"x-specrouter-backend"] == b"b0"
        (_, sent), = e0.requests
        assert sent["messages"][-1] == {"role": "assistant", "content": "Hello"}
        assert sent["max_tokens"] == 98  # a baseline event is one token
        while not b0.aborts:
            await asyncio.sleep(0)

    run(scenario())


def test_a_stream_past_half_its_output_budget_stays_where_it_is() -> None:
    async def scenario() -> None:
        exchange, _, e0, b0 = await _switch_mid_stream({**PLAIN, "max_tokens": 4}, 2)
        assert _contents(exchange.content)[0] == "Hello world"
        assert not b0.requests and not e0.aborts

    run(scenario())


def test_a_request_a_continuation_cannot_carry_on_stays_where_it_is() -> None:
    async def scenario() -> None:
        exchange, _, e0, b0 = await _switch_mid_stream({**PLAIN, "stop": ["\n"]}, 2)
        assert _contents(exchange.content)[0] == "Hello world"
        assert not b0.requests and not e0.aborts

    run(scenario())


def test_a_stream_whose_context_exceeds_the_switch_budget_stays_where_it_is() -> None:
    async def scenario() -> None:
        # the prompt alone is more than the budget
        exchange, router, _, b0 = await _switch_mid_stream(PLAIN, 2, budget=10)
        assert _contents(exchange.content)[0] == "Hello world"
        assert not b0.requests and router.recalls[0].budget is not None
        assert router.recalls[0].budget.left == 10

    run(scenario())


def test_a_refused_continuation_ends_the_stream_with_an_error_event() -> None:
    async def scenario() -> None:
        refused = Gated([b'{"object":"error","message":"no","code":400}'], status=400,
                        headers=JSON)
        exchange, *_ = await _switch_mid_stream(PLAIN, 1, baseline=refused)
        raw = exchange.content
        assert _contents(raw)[0] == "Hel"
        assert b'"error"' in raw and raw.endswith(DONE)
        assert [m["type"] for m in exchange.sent].count("http.response.start") == 1

    run(scenario())


def test_what_a_continuation_can_carry_on() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    assert continuable(CHAT, chat)
    assert continuable(CHAT, {**chat, "stop": [], "tool_choice": "none", "logprobs": False,
                              "response_format": {"type": "text"}})
    for blocking in ({"stream": False}, {"n": 2}, {"tools": [{"type": "function"}]},
                     {"stop": "\n"}, {"response_format": {"type": "json_object"}},
                     {"logprobs": True}, {"rid": "mine"}, {"continue_final_message": True},
                     {"messages": [{"role": "assistant", "content": "x"}]}):
        assert not continuable(CHAT, {**chat, **blocking}), blocking
    assert continuable("/v1/completions", {"prompt": ["once"], "stream": True})
    assert not continuable("/v1/completions", {"prompt": [1, 2], "stream": True})
    assert not continuable("/generate", {"text": "x", "stream": True})


def test_what_was_sent_and_what_continues_it() -> None:
    sent = read_sent(FIRST[0] + _event("lo"), chat=True)
    assert sent is not None and (sent.text, sent.events, sent.id) == ("Hello", 2, "e")
    assert read_sent(FIRST[0] + _event(finish="stop"), chat=True) is None
    tool = _event().replace(b'"delta":{}', b'"delta":{"tool_calls":[{"index":0}]}')
    assert read_sent(FIRST[0] + tool, chat=True) is None
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 11}
    handed = continuation(CHAT, body, sent, accept_length=2.5)
    assert handed is not None and handed.tokens_sent == 5
    assert json.loads(handed.body)["max_completion_tokens"] == 6
    # half its output budget spent: about to end, it stays where it is
    assert continuation(CHAT, {**body, "max_completion_tokens": 10}, sent, 2.5) is None
    text = read_sent(b'data: {"id":"c","created":1,"model":"m","choices":[{"index":0,'
                     b'"text":"once","finish_reason":null}]}\n\n', chat=False)
    assert text is not None
    handed = continuation("/v1/completions", {"prompt": "Tell", "stream": True}, text, None)
    assert handed is not None
    assert json.loads(handed.body) == {"prompt": "Tellonce", "stream": True, "max_tokens": 15}


def test_a_restamp_passes_whole_events_only() -> None:
    sent = read_sent(FIRST[0], chat=True)
    assert sent is not None
    handed = continuation(CHAT, {"messages": [{"role": "user", "content": "x"}]}, sent, None)
    assert handed is not None
    restamp = Restamp(handed)
    data = b"".join(CONTINUED)
    out = restamp.feed(data[:40]) + restamp.feed(data[40:]) + restamp.flush()
    text, ids, _ = _contents(out)
    assert text == " there" and ids == {"e"} and out.endswith(DONE)


def test_a_relay_stops_recording_a_stream_past_its_record_limit() -> None:
    relay = StreamRelay(None, record_limit=10)
    relay.sent(b"12345")
    relay.sent(b"67890")
    assert relay.record == [b"12345", b"67890"]
    relay.sent(b"x")  # the stream is now longer than any handover could take
    assert relay.record is None and relay.tail.endswith(b"x")
    assert StreamRelay(None).record is None
