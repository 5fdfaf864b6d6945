"""The callback path (`proxy.fastpath`) through a real uvicorn with the router's protocol, the
native transport and scripted backends on loopback: what a client gets is what the
coroutine path gives it, and every case the callback path cannot finish on callbacks
(no idle connection, a retry, a recall, an arrival window, a handover) goes on on the
coroutine path without a byte lost or a count leaked."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from loadtest import loopback
from specrouter.backends import Backend
from specrouter.config import load_settings
from specrouter.control.metrics import RouterMetrics
from specrouter.edge import SpecRouterApp, create_app
from specrouter.proxy.fastpath import CallbackMetrics, FastExchange, FastPath
from specrouter.routing.arrivals import Arrival
from specrouter.routing.router import HandoverBudget
from tests.edge.serving import guarded_server
from tests.fixtures.fake_router import ListRouter
from tests.fixtures.http_server import read_request
from tests.fixtures.procs import eventually
from tests.proxy.test_handover import _contents, _event

DONE = b"data: [DONE]\n\n"
QUEUE_FULL = (b'data: {"error": {"object": "error", "message": "The request queue is full.",'
              b' "type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n' + DONE)
STREAM_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
               "max_tokens": 64}


def event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()


ANSWER = [event("a"), event("b"), DONE]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


Reply = Callable[[asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


def stream_reply(events: list[bytes], gate: asyncio.Event | None = None,
                 quiet: bool = False) -> Reply:
    """A chunked SSE answer, one write per event; with `gate`, the events after the first
    wait for it, and with `quiet` never come (the backend goes silent mid-stream)."""
    async def reply(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for n, data in enumerate(events):
            if n == 1 and gate is not None:
                await gate.wait()
            if n == 1 and quiet:
                await asyncio.Event().wait()
            writer.write(_chunk(data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
    return reply


def json_reply(status: int, payload: dict[str, Any]) -> Reply:
    async def reply(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (status, len(data), data))
    return reply


@dataclass
class ScriptedBackend:
    """A keep-alive HTTP/1.1 server: each generation is answered by the next reply of
    `replies` (the last one repeats); `/abort_request` by 200. Records what it got."""

    replies: list[Reply]
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    connections: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set at each generation

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head, raw = await read_request(reader)
                body = json.loads(raw or b"{}")
                if head.startswith(b"POST /abort_request"):
                    self.aborts.append(body["rid"])
                    self.aborted.set()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                self.requests.append(body)
                self.arrived.set()
                await self.replies[min(len(self.requests), len(self.replies)) - 1](
                    writer, body)
                await writer.drain()


@dataclass
class Counted:
    """The callback path's metrics: the requests it served (status) and handed on."""

    served: list[int] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)

    def observe_request(self, pool: str, backend: str, status: int, ttft_s: float | None,
                        e2e_s: float) -> None:
        self.served.append(status)

    def observe_fallback(self, reason: str) -> None:
        self.fallbacks.append(reason)


@dataclass
class Harness:
    app: SpecRouterApp
    router: ListRouter
    e0: ScriptedBackend
    b0: ScriptedBackend
    client: httpx.AsyncClient
    taken: list[bool]  # per request offered to the callback path: whether it kept it
    counted: Counted

    async def post(self, body: dict[str, Any] | None = None) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=body or STREAM_CHAT)

    async def settled(self) -> None:
        """Every backend released (an abort answered, a relay ended)."""
        while any(self.router.held.values()):
            self.router.released.clear()
            await self.router.released.wait()


@contextlib.asynccontextmanager
async def harness(e0: list[Reply], b0: list[Reply] | None = None, callback_path: bool = True,
                  armed_recall: bool = False, metrics: CallbackMetrics | None = None,
                  **settings: Any) -> AsyncIterator[Harness]:
    """The app (`callback_path` on or off) in front of two scripted backends (e0, then
    b0 when e0 is excluded or recalled), served by uvicorn with the router's protocol.
    One stream per backend straight through its upstream leaves an idle keep-alive
    connection to each, as a router that served before has."""
    backends = [ScriptedBackend([stream_reply(ANSWER), *e0]),
                ScriptedBackend([stream_reply(ANSWER), *(b0 or [stream_reply(ANSWER)])])]
    servers = [await asyncio.start_server(b.serve, "127.0.0.1", 0) for b in backends]
    listed = [Backend(name, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", pool,
                      "g0")
              for name, pool, server in zip(("e0", "b0"), ("eagle", "baseline"), servers,
                                            strict=True)]
    router = ListRouter(armed_recall=armed_recall, backends=listed)
    config = load_settings(environ={}, overrides={
        "backends": [{"name": b.name, "url": b.url, "pool": b.pool, "group": b.group}
                     for b in listed],
        "listen": {"callback_path": callback_path}, **settings})
    counted = Counted()
    app = create_app(config, router, metrics=metrics or counted)
    taken: list[bool] = []
    if app.fast_path is not None:
        _spy(app.fast_path, taken)
    try:
        for upstream in app.proxy.upstreams.values():
            warm = await upstream.open("POST", "/v1/chat/completions", [], b"{}", stream=True)
            assert [c async for c in warm.iter_raw()]
            await warm.aclose()
        async with guarded_server(app) as port, loopback.async_client(
                base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield Harness(app, router, backends[0], backends[1], client, taken, counted)
    finally:
        await asyncio.gather(*(u.aclose() for u in app.proxy.upstreams.values()))
        for server in servers:
            server.close()


def _spy(fast: FastPath, taken: list[bool]) -> None:
    take = fast.take

    def spied(client: Any) -> FastExchange | None:
        exchange = take(client)
        taken.append(exchange is not None)
        return exchange

    fast.take = spied  # type: ignore[method-assign]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(20):
            await scenario()

    asyncio.run(bounded())


@pytest.mark.parametrize("callback_path", [True, False])
def test_a_stream_on_callbacks_is_the_stream_the_coroutine_path_gives(
        callback_path: bool) -> None:
    answers: list[tuple[int, dict[str, str], bytes]] = []

    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)], callback_path=callback_path) as h:
            for _ in range(3):
                r = await h.post()
                headers = {k: v for k, v in r.headers.items()
                           if k.startswith("x-specrouter-") or k == "content-type"}
                answers.append((r.status_code, headers, r.content))
            assert h.taken == ([True] * 3 if callback_path else [])
            assert h.counted.served == ([200] * 3 if callback_path else [])
            assert h.counted.fallbacks == []
            assert h.router.outcomes == [("e0", True)] * 3
            assert not any(h.router.held.values())
            assert h.e0.connections == 1  # one keep-alive connection carried them all
            assert all("rid" in body for body in h.e0.requests[1:])  # after the warm-up

    run(scenario)
    assert answers == [(200, {"content-type": "text/event-stream",
                              "x-specrouter-pool": "eagle", "x-specrouter-backend": "e0",
                              "x-specrouter-reason": "test"},
                        b"".join(ANSWER))] * 3


def test_without_an_idle_connection_the_coroutine_path_serves_the_request() -> None:
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)]) as h:
            first, second = await asyncio.gather(h.post(), h.post())  # one idle connection
            assert first.content == second.content == b"".join(ANSWER)
            assert sorted(h.taken) == [False, True]
            assert h.counted.fallbacks == ["not_started"]
            assert h.e0.connections == 2
            assert len(h.router.requests) == 2  # each chosen once

    run(scenario)


async def _close_unanswered(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    writer.close()  # a keep-alive connection the backend dropped as it was reused


def test_a_stale_connection_hands_its_target_on_still_counted_in_flight() -> None:
    async def scenario() -> None:
        async with harness([_close_unanswered, stream_reply(ANSWER)]) as h:
            held: list[int] = []  # e0's count in flight after each change
            for name in ("acquire", "release"):
                change = getattr(h.router, name)

                def logged(target: Any, change: Any = change) -> None:
                    change(target)
                    held.append(h.router.held["e0"])

                setattr(h.router, name, logged)
            r = await h.post()
            assert r.content == b"".join(ANSWER)
            assert h.counted.fallbacks == ["stale_connection"]
            assert h.e0.connections == 2  # the request went again on a fresh connection
            assert len(h.router.requests) == 1  # chosen once
            await h.settled()
            assert held == [1, 0]  # counted from the choice to the answer's end, once

    run(scenario)


def test_a_queue_full_first_event_is_retried_on_the_other_backend() -> None:
    async def scenario() -> None:
        async with harness([stream_reply([QUEUE_FULL])]) as h:
            r = await h.post()
            assert r.content == b"".join(ANSWER)
            assert r.headers["x-specrouter-backend"] == "b0"
            assert h.taken == [True]
            assert h.router.outcomes == [("e0", False), ("b0", True)]
            assert h.router.requests[-1].exclude == frozenset({"e0"})
            assert h.counted.fallbacks == ["retry"]
            await h.settled()

    run(scenario)


def test_a_retryable_status_is_retried_on_the_other_backend() -> None:
    async def scenario() -> None:
        async with harness([json_reply(503, {"error": "busy"})]) as h:
            r = await h.post()
            assert r.status_code == 200 and r.headers["x-specrouter-backend"] == "b0"
            assert h.router.outcomes == [("e0", False), ("b0", True)]
            await h.settled()

    run(scenario)


def test_a_request_that_should_wait_for_the_arrival_window_waits_on_the_coroutine_path(
        ) -> None:
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)]) as h:
            h.router.arrival = Arrival(0.0, 1)
            r = await h.post()
            assert r.content == b"".join(ANSWER)
            assert h.taken == [False] and h.router.waited == [Arrival(0.0, 1)]
            assert h.counted.fallbacks == ["arrival_window"]

    run(scenario)


def test_a_recall_before_the_first_byte_aborts_the_attempt_and_routes_again() -> None:
    async def no_answer(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        await asyncio.Event().wait()

    async def scenario() -> None:
        async with harness([no_answer], armed_recall=True) as h:
            request = asyncio.ensure_future(h.post())
            h.e0.arrived.clear()
            await h.e0.arrived.wait()
            h.router.recalls[-1].set()
            r = await request
            assert r.headers["x-specrouter-backend"] == "b0"
            assert r.content == b"".join(ANSWER)
            await h.e0.aborted.wait()
            assert h.e0.aborts == [h.e0.requests[-1]["rid"]]
            assert h.taken == [True] and h.router.requests[-1].recalled
            assert h.counted.fallbacks == ["recall"]
            await h.settled()

    run(scenario)


def test_a_client_that_leaves_mid_stream_gets_its_request_aborted() -> None:
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER, quiet=True)]) as h:
            async with h.client.stream("POST", "/v1/chat/completions",
                                       json=STREAM_CHAT) as r:
                assert await r.aiter_raw().__anext__() == ANSWER[0]
                assert h.router.held["e0"] == 1
            # the client closed its connection mid-stream
            await h.e0.aborted.wait()
            assert h.e0.aborts == [h.e0.requests[-1]["rid"]]
            await h.settled()
            assert h.taken == [True] and h.router.outcomes == []

    run(scenario)


def test_a_backend_silent_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER, quiet=True)],
                           timeouts={"first_byte": 0.3}) as h:
            r = await h.post()
            assert r.content.startswith(ANSWER[0])
            assert b"went silent" in r.content and b'"code": 504' in r.content
            assert h.taken == [True] and h.router.outcomes == [("e0", False)]
            await h.settled()

    run(scenario)


def test_a_non_stream_answer_and_an_error_status_are_relayed_whole() -> None:
    async def scenario() -> None:
        answer = {"choices": [{"message": {"content": "hi"}}]}
        async with harness([json_reply(200, answer), json_reply(400, {"error": "bad"})]) as h:
            r = await h.post({**STREAM_CHAT, "stream": False})
            assert r.json() == answer and r.headers["content-length"] == str(len(r.content))
            bad = await h.post()
            assert bad.status_code == 400 and bad.json() == {"error": "bad"}
            assert h.taken == [True, True]
            assert h.router.outcomes == [("e0", True), ("e0", True)]

    run(scenario)


def test_a_stream_handed_over_mid_way_goes_on_on_the_other_backend() -> None:
    gate = asyncio.Event()
    first = [_event(role=True) + _event("Hel"), _event(" world"), _event(finish="length") + DONE]
    continued = [_event(role=True, stamp="b") + _event("lo", stamp="b"),
                 _event(finish="length", stamp="b") + DONE]

    async def scenario() -> None:
        body = {**STREAM_CHAT, "stream_options": {"include_usage": False}}
        async with harness([stream_reply(first, gate=gate)], b0=[stream_reply(continued)],
                           armed_recall=True) as h:
            async with h.client.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = r.aiter_raw()
                assert await chunks.__anext__() == first[0]
                recall = h.router.recalls[-1]
                recall.budget = HandoverBudget(1e6)
                recall.set()  # the group switched: e0's next event is held ...
                gate.set()  # ... and, at an event boundary, the stream moves to b0
                rest = b"".join([c async for c in chunks])
            text, ids, _ = _contents(first[0] + rest)
            assert text == "Hello" and ids == {"e"}
            assert h.b0.requests[-1]["messages"][-1] == {"role": "assistant",
                                                         "content": "Hel"}
            assert h.taken == [True] and h.counted.fallbacks == ["handover"]
            await h.e0.aborted.wait()
            await h.settled()

    run(scenario)


def test_while_draining_the_app_answers_503() -> None:
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)]) as h:
            h.app.lifecycle.draining = True
            r = await h.post()
            assert r.status_code == 503 and h.taken == [False]
            assert h.counted.fallbacks == ["app"]

    run(scenario)


def test_a_non_stream_answer_may_take_longer_than_a_streams_first_byte() -> None:
    async def slow(writer: asyncio.StreamWriter, body: dict[str, Any]) -> None:
        await asyncio.sleep(0.5)
        await json_reply(200, {"ok": True})(writer, body)

    async def scenario() -> None:
        async with harness([slow], timeouts={"first_byte": 0.2, "total": 5}) as h:
            r = await h.post({**STREAM_CHAT, "stream": False})
            assert r.status_code == 200 and r.json() == {"ok": True}
            assert h.taken == [True]

    run(scenario)


def test_the_requests_served_and_handed_on_are_in_the_routers_metrics() -> None:
    metrics = RouterMetrics()

    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)], metrics=metrics) as h:
            await h.post()
            h.app.lifecycle.draining = True
            await h.post()

    run(scenario)
    text = metrics.render().decode()
    assert ('specrouter_requests_total{backend="e0",pool="eagle",status="200"} 1.0'
            in text)
    assert 'specrouter_callback_fallbacks_total{reason="app"} 1.0' in text


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, its framing removed."""
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readexactly(2)
    return body


def test_pipelined_requests_are_answered_in_order_on_callbacks() -> None:
    """Two requests in one write: the second waits in uvicorn's pipeline and starts on
    callbacks as the first one's response completes."""
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)]) as h:
            port = int(str(h.client.base_url).rsplit(":", 1)[1].rstrip("/"))
            body = json.dumps(STREAM_CHAT).encode()
            request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                       b"content-type: application/json\r\ncontent-length: %d\r\n"
                       b"x-request-id: r%%d\r\n\r\n%b" % (len(body), body))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request % 1 + request % 2)
            answers = []
            for _ in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head
                answers.append(head)
                assert await _read_chunked(reader) == b"".join(ANSWER)
            writer.close()
            assert [b"x-request-id: r1" in answers[0], b"x-request-id: r2" in answers[1]] == [
                True, True]
            assert h.taken == [True, True] and h.counted.served == [200, 200]

    run(scenario)


def _post_head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % length)


def _port(h: Harness) -> int:
    return int(str(h.client.base_url).rsplit(":", 1)[1].rstrip("/"))


def test_a_long_prompt_arriving_in_pieces_runs_on_callbacks() -> None:
    """A body past one read is awaited with its length reserved in the body budget; a
    body past one write slice goes to the backend whole."""
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)]) as h:
            prompt = "x" * 400_000
            body = json.dumps({**STREAM_CHAT, "messages": [
                {"role": "user", "content": prompt}]}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(h))
            first = 200_000  # past the 64 KiB at which uvicorn stops reading an unread body
            writer.write(_post_head(len(body)) + body[:first])
            await eventually(lambda: h.app.proxy.bodies.held == len(body),
                             what="the body's length reserved")
            assert h.app.lifecycle.active == 1  # a drain waits for it
            writer.write(body[first:])
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert await _read_chunked(reader) == b"".join(ANSWER)
            writer.close()
            assert h.taken == [True]
            assert h.e0.requests[-1]["messages"][0]["content"] == prompt
            await h.settled()
            assert h.app.proxy.bodies.held == 0 and h.app.lifecycle.active == 0

    run(scenario)


def test_a_body_that_stops_arriving_gets_408_and_frees_its_reservation() -> None:
    async def scenario() -> None:
        async with harness([stream_reply(ANSWER)], limits={"body_timeout_s": 0.3}) as h:
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(h))
            writer.write(_post_head(5000) + b'{"model": "m", ')
            answer = await reader.read()  # the router closes the connection
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408")
            assert b"request body not received within 0.3 s" in answer
            assert h.taken == [] and h.app.proxy.bodies.held == 0
            assert h.app.lifecycle.active == 0
            assert len(h.e0.requests) == 1  # the warm-up only

    run(scenario)
