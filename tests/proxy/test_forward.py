"""One request's cycle through the proxy, in process, against scripted backends: the held
stream head, SGLang's queue-full stream retried elsewhere, the rid of each attempt and the
abort of an attempt the router leaves unfinished (client gone, recall), which keeps
counting in flight until its backend acknowledged the abort."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.types import Message

from specrouter.config import load_settings
from specrouter.edge import SpecRouterApp, create_app
from specrouter.proxy import forward
from specrouter.proxy.abort import client_rids, rid_field
from specrouter.proxy.first_event import event_status
from specrouter.proxy.request import with_first_fields
from specrouter.proxy.upstream import ChunkWriter, RawHeaders, UpstreamResponse
from specrouter.proxy.usage import USAGE_FIELD
from specrouter.routing.router import Target
from tests.fixtures.fake_router import BACKENDS, ListRouter

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"
# SGLang 0.5.23's queue-full answer to a stream (serving_chat.py:2568-2580,
# serving_base.py:223-237): HTTP 200, one error event, [DONE].
QUEUE_FULL = (b'data: {"error": {"object": "error", "message": "The request queue is full.",'
              b' "type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n' + DONE)
# /generate's (tokenizer_manager.py:1891-1922 returns the output; http_server.py:956 sends it)
GENERATE_QUEUE_FULL = (b'data: {"text":"","output_ids":[],"meta_info":{"id":"x","finish_reason":'
                       b'{"type":"abort","message":"The request queue is full.",'
                       b'"status_code":503}}}\n\n' + DONE)
ANSWER = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n' + DONE


class Scripted:
    """A response whose chunks are released one by one (`gate`) or all at once."""

    def __init__(self, status: int, headers: RawHeaders, chunks: Sequence[bytes],
                 gate: asyncio.Queue[None] | None = None) -> None:
        self.status = status
        self.headers = headers
        self.chunks = chunks
        self.gate = gate
        self.closed = False

    def divert(self, write: ChunkWriter) -> bool:
        return False  # every chunk through iter_raw, as the httpx transport does

    async def iter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if self.gate is not None:
                await self.gate.get()
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


class Backend_:
    """Answers generations with `answer()`; answers `/abort_request` with `abort_status`
    once `abort_gate` is set. Records every request."""

    def __init__(self, stream: bytes | Sequence[bytes] = ANSWER, *, hang: bool = False,
                 abort_status: int = 200, gate: asyncio.Queue[None] | None = None) -> None:
        self.chunks = [stream] if isinstance(stream, bytes) else list(stream)
        self.gate = gate
        self.hang = hang
        self.abort_status = abort_status
        self.abort_gate = asyncio.Event()
        self.abort_gate.set()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.aborts: list[dict[str, Any]] = []
        self.abort_headers: list[RawHeaders] = []

    async def open(self, method: str, path: str, headers: RawHeaders, body: bytes, *,
                   stream: bool) -> UpstreamResponse:
        if path == "/abort_request":
            self.aborts.append(json.loads(body))
            self.abort_headers.append(headers)
            await self.abort_gate.wait()
            return Scripted(self.abort_status, [], [b""])
        self.requests.append((path, json.loads(body)))
        if self.hang:
            await asyncio.Event().wait()
        return Scripted(200, SSE, self.chunks, self.gate)

    async def aclose(self) -> None:
        pass


def make_app(router: ListRouter, e0: Backend_, b0: Backend_, **upstream: Any) -> SpecRouterApp:
    settings = load_settings(environ={}, overrides={
        "backends": [{"name": b.name, "url": b.url, "pool": b.pool, "group": b.group}
                     for b in BACKENDS],
        "upstream": upstream,
    })
    return create_app(settings, router, {"e0": e0, "b0": b0})


class Exchange:
    """One request through the app's ASGI interface; `leave()` disconnects the client."""

    def __init__(self, app: SpecRouterApp, path: str, body: dict[str, Any],
                 request_id: bytes = b"req-1") -> None:
        self.app = app
        self.path = path
        self.body = json.dumps(body).encode()
        self.headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id)]
        self.sent: list[Message] = []
        self.started = asyncio.Event()
        self._gone = asyncio.Event()
        self._body_sent = False

    def leave(self) -> None:
        self._gone.set()

    async def _receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.start":
            self.started.set()

    async def run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path,
                 "raw_path": self.path.encode(), "query_string": b"", "headers": self.headers,
                 "client": ("127.0.0.1", 1), "server": ("router", 80)}
        await self.app(scope, self._receive, self._send)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def header(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def content(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def run(scenario: Coroutine[Any, Any, None]) -> None:
    """Run a scenario; one that waits for what never comes fails instead of hanging."""
    async def bounded() -> None:
        async with asyncio.timeout(10):
            await scenario

    asyncio.run(bounded())


STREAM_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
# what the proxy adds to a stream that did not set stream_options (proxy/usage.py)
ASKED = {"stream_options": {"include_usage": True}}


def test_the_stream_head_leaves_with_the_first_chunk() -> None:
    async def scenario() -> None:
        gate: asyncio.Queue[None] = asyncio.Queue()
        response = Scripted(200, SSE, [b'data: {"a":1}\n\n', DONE], gate)

        class Slow(Backend_):
            async def open(self, *args: Any, **kwargs: Any) -> UpstreamResponse:
                return response

        router = ListRouter()
        exchange = Exchange(make_app(router, Slow(), Backend_()), "/v1/chat/completions",
                            STREAM_CHAT)
        task = asyncio.create_task(exchange.run())
        try:
            for _ in range(20):  # the upstream answered its head; the client's waits
                await asyncio.sleep(0)
            assert exchange.sent == []
            gate.put_nowait(None)
            await exchange.started.wait()
            assert [m["type"] for m in exchange.sent] == ["http.response.start",
                                                          "http.response.body"]
            gate.put_nowait(None)
            await task
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert exchange.content == b'data: {"a":1}\n\n' + DONE

    run(scenario())


@pytest.mark.parametrize(("path", "queue_full"), [
    ("/v1/chat/completions", QUEUE_FULL), ("/generate", GENERATE_QUEUE_FULL)])
def test_a_queue_full_stream_is_answered_by_another_backend(path: str, queue_full: bytes) -> None:
    async def scenario() -> None:
        router, e0, b0 = ListRouter(), Backend_(queue_full), Backend_()
        exchange = Exchange(make_app(router, e0, b0), path, STREAM_CHAT)
        await exchange.run()
        assert exchange.status == 200 and exchange.header[b"x-specrouter-backend"] == b"b0"
        assert exchange.content == ANSWER
        assert router.outcomes == [("e0", False), ("b0", True)]
        assert router.held == {"e0": 0, "b0": 0}  # SGLang ended it: nothing to abort
        assert e0.aborts == []

    run(scenario())


def test_without_another_backend_the_queue_full_stream_reaches_the_client_as_sent() -> None:
    async def scenario() -> None:
        router, e0, b0 = ListRouter(), Backend_(QUEUE_FULL), Backend_(QUEUE_FULL)
        exchange = Exchange(make_app(router, e0, b0), "/v1/chat/completions", STREAM_CHAT)
        await exchange.run()  # e0 retried on b0, whose answer is final
        assert exchange.status == 200 and exchange.content == QUEUE_FULL
        assert exchange.header[b"x-specrouter-backend"] == b"b0"
        assert router.held == {"e0": 0, "b0": 0}

    run(scenario())


def test_each_attempt_carries_its_own_rid_and_a_client_rid_is_kept() -> None:
    async def scenario() -> None:
        router, e0, b0 = ListRouter(), Backend_(QUEUE_FULL), Backend_()
        await Exchange(make_app(router, e0, b0), "/v1/chat/completions", STREAM_CHAT,
                       b"abc").run()
        (_, first), (_, second) = e0.requests[0], b0.requests[0]
        assert first["rid"].endswith("-abc") and second["rid"].endswith("-abc")
        assert first["rid"] != second["rid"]
        assert {k: v for k, v in first.items() if k != "rid"} == {**STREAM_CHAT, **ASKED}

        mine = {**STREAM_CHAT, "rid": "client-rid"}
        await Exchange(make_app(ListRouter(), e0, b0), "/generate", mine).run()
        assert e0.requests[1][1] == mine

    run(scenario())


def test_a_client_that_leaves_gets_its_request_aborted_and_counted_until_then() -> None:
    async def scenario() -> None:
        router, e0 = ListRouter(), Backend_(hang=True)
        e0.abort_gate.clear()  # the backend takes its time to acknowledge the abort
        exchange = Exchange(make_app(router, e0, Backend_()), "/v1/chat/completions",
                            STREAM_CHAT, b"gone-1")
        task = asyncio.create_task(exchange.run())
        while not e0.requests:
            await asyncio.sleep(0)
        exchange.leave()
        await task
        while not e0.aborts:
            await asyncio.sleep(0)
        rid = e0.requests[0][1]["rid"]
        assert e0.aborts == [{"rid": rid}]
        assert (b"x-request-id", b"gone-1") in e0.abort_headers[0]
        assert router.held["e0"] == 1  # SGLang still holds it
        e0.abort_gate.set()
        await router.released.wait()
        assert router.held == {"e0": 0, "b0": 0}

    run(scenario())


def test_a_client_that_leaves_after_done_had_the_whole_answer() -> None:
    """The OpenAI client closes at `[DONE]`, before the upstream's end of body: nothing is
    aborted and the cycle ends as answered."""
    async def scenario() -> None:
        gate: asyncio.Queue[None] = asyncio.Queue()
        router = ListRouter()
        e0 = Backend_([ANSWER, b""], gate=gate)
        exchange = Exchange(make_app(router, e0, Backend_()), "/v1/chat/completions",
                            STREAM_CHAT)
        task = asyncio.create_task(exchange.run())
        gate.put_nowait(None)
        while not exchange.content.endswith(DONE):
            await asyncio.sleep(0)
        exchange.leave()
        await asyncio.sleep(0)  # one loop turn: the watcher reads the disconnect first
        gate.put_nowait(None)
        await task
        assert e0.aborts == []
        assert exchange.sent[-1] == {"type": "http.response.body", "body": b"",
                                     "more_body": False}
        assert router.held == {"e0": 0, "b0": 0}

    run(scenario())


def test_a_recalled_attempt_is_aborted_by_its_rid() -> None:
    async def scenario() -> None:
        router, e0, b0 = ListRouter(armed_recall=True), Backend_(hang=True), Backend_()
        e0.abort_gate.clear()
        exchange = Exchange(make_app(router, e0, b0), "/v1/chat/completions", STREAM_CHAT)
        task = asyncio.create_task(exchange.run())
        while not e0.requests:  # the group switches once the attempt reached EAGLE-3
            await asyncio.sleep(0)
        router.recalls[0].set()
        await task
        assert exchange.header[b"x-specrouter-backend"] == b"b0"
        assert exchange.content == ANSWER
        while not e0.aborts:
            await asyncio.sleep(0)
        assert e0.aborts == [{"rid": e0.requests[0][1]["rid"]}]
        assert router.held == {"e0": 1, "b0": 0}
        e0.abort_gate.set()
        while router.held["e0"]:
            await asyncio.sleep(0)

    run(scenario())


def test_an_abort_the_backend_refuses_holds_the_count_for_the_bounded_time() -> None:
    async def scenario() -> None:
        router, e0 = ListRouter(), Backend_(hang=True, abort_status=404)  # no such route
        app = make_app(router, e0, Backend_(), abandoned_hold_s=0.3)
        exchange = Exchange(app, "/v1/chat/completions", {**STREAM_CHAT, "rid": "mine"})
        task = asyncio.create_task(exchange.run())
        while not e0.requests:
            await asyncio.sleep(0)
        exchange.leave()
        await task
        left = asyncio.get_running_loop().time()
        await router.released.wait()
        held = asyncio.get_running_loop().time() - left
        assert e0.aborts == [{"rid": "mine"}]  # the client's own rid
        assert 0.25 <= held < 2.0 and router.held["e0"] == 0

    run(scenario())


def test_with_aborts_off_a_body_gets_no_rid() -> None:
    async def scenario() -> None:
        router, e0 = ListRouter(), Backend_()
        app = make_app(router, e0, Backend_(), abort_abandoned=False)
        await Exchange(app, "/v1/chat/completions", STREAM_CHAT).run()
        assert e0.requests[0][1] == {**STREAM_CHAT, **ASKED}  # no rid

    run(scenario())


@pytest.mark.parametrize(("body", "rids"), [
    (b'{"model":"m"}', None),
    (b'{"messages":[{"content":"the \\"rid\\" field"}]}', None),
    (b'{"messages":[{"rid":"inner"}]}', None),
    (b'{"rid":"r1"}', ("r1",)),
    (b'{"rid":["a","b"]}', ("a", "b")),
    (b'{"rid":""}', ()),
    (b'{"rid":null}', ()),
    (b'{"rid":7}', ()),
])
def test_client_rids(body: bytes, rids: tuple[str, ...] | None) -> None:
    assert client_rids(body) == rids


@pytest.mark.parametrize("body", [b'{"a":1}', b'  {}', b'{ }', b'\n{"a":{"b":[]}}'])
def test_with_first_fields_keeps_the_body_and_adds_the_fields(body: bytes) -> None:
    fields = rid_field('x"\\y') + b"," + USAGE_FIELD
    for buffer in (body, bytearray(body)):
        assert json.loads(with_first_fields(buffer, fields)) == {
            "rid": 'x"\\y', "stream_options": {"include_usage": True}, **json.loads(body)}


@pytest.mark.parametrize(("first", "status"), [
    (QUEUE_FULL, 503), (GENERATE_QUEUE_FULL, 503), (ANSWER, None),
    (b'data: {"error": {"message": "bad", "code": 400}}\n\n', 400),
    (b'data: {"choices":[{"finish_reason":"abort"}]}\n\n', None),
    (b'data: {"error": "not json', None),
])
def test_event_status(first: bytes, status: int | None) -> None:
    assert event_status(first) == status


USAGE = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":'
         b'{"prompt_tokens":30000,"total_tokens":30256,"completion_tokens":256,'
         b'"prompt_tokens_details":{"cached_tokens":27500},"reasoning_tokens":0}}\n\n')
# generated text naming the keys is escaped, so only the usage counts
TEXT = (b'data: {"choices":[{"delta":{"content":"\\"cached_tokens\\": 9, '
        b'\\"prompt_tokens\\": 9"}}]}\n\n')


def test_a_streams_usage_tells_the_router_what_the_engine_had_cached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the relay's clock: the first chunk at 10.0 s, the end 0.51 s later (then the
    # second stream's first chunk)
    ticks = iter([10.0, 10.51, 20.0])
    monkeypatch.setattr(forward, "time", SimpleNamespace(monotonic=lambda: next(ticks)))

    async def scenario() -> None:
        router = ListRouter()
        e0 = Backend_([TEXT, TEXT, USAGE, DONE])
        await Exchange(make_app(router, e0, Backend_()), "/v1/chat/completions",
                       STREAM_CHAT).run()
        assert router.cached == [("e0", 30000, 27500)]
        # and how fast it came: 510 ms over the 255 tokens after the first
        assert router.paces == [("e0", pytest.approx(2.0))]
        without = ListRouter()  # no usage event (include_usage off): nothing reported
        await Exchange(make_app(without, Backend_([TEXT, DONE]), Backend_()),
                       "/v1/chat/completions", STREAM_CHAT).run()
        assert without.cached == [] and without.paces == []
        assert next(ticks, None) is None  # the second stream's end was never timed

    run(scenario())


def test_a_non_stream_answer_tells_the_router_what_the_engine_had_cached() -> None:
    async def scenario() -> None:
        body = (b'{"text":"\\"cached_tokens\\": 1","meta_info":{"prompt_tokens":4000,'
                b'"completion_tokens":8,"cached_tokens":3968,"e2e_latency":0.1}}')

        class Whole(Backend_):
            async def open(self, *args: Any, **kwargs: Any) -> UpstreamResponse:
                return Scripted(200, JSON, [body])

        router = ListRouter()
        exchange = Exchange(make_app(router, Whole(), Backend_()), "/generate",
                            {"text": "hi", "sampling_params": {"max_new_tokens": 8}})
        await exchange.run()
        assert exchange.content == body
        assert router.cached == [("e0", 4000, 3968)]
        assert router.paces == []  # a whole answer tells nothing of its pace

    run(scenario())


def test_a_target_the_callback_path_acquired_is_released_exactly_once() -> None:
    """`Owed`: taken over by the attempt (which releases it itself), or given back when
    the request's app task ends without an attempt; never both, never twice."""
    target = Target("g", "eagle", BACKENDS[0], "test")
    released: list[Target] = []
    untaken = forward.Owed(target, released.append)
    untaken.settle()
    untaken.settle()
    assert released == [target]
    taken = forward.Owed(target, released.append)
    taken.take()
    taken.settle()
    assert released == [target]
