"""The edge in process: its route table, the drain, /v1/models, and one request's cycle
(retry, recall) against an in-memory router and in-memory backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp

from loadtest import loopback
from specrouter.backends import Backend
from specrouter.config import load_settings
from specrouter.edge import SpecRouterApp, create_app
from specrouter.proxy.upstream import (
    ChunkWriter,
    RawHeaders,
    RequestBody,
    UpstreamLocalError,
    UpstreamResponse,
    UpstreamUnreachable,
)
from specrouter.routing.arrivals import GENERATION_PATHS
from tests.fixtures.fake_router import BACKENDS, ListRouter

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Answer:
    def __init__(self, body: bytes, headers: RawHeaders) -> None:
        self.status = 200
        self.headers = headers
        self._body = body

    def divert(self, write: ChunkWriter) -> bool:
        return False  # every chunk through iter_raw, as the httpx transport does

    async def iter_raw(self) -> AsyncIterator[bytes]:
        yield self._body

    async def aclose(self) -> None:
        pass


class FakeBackend:
    """Answers every request with `body`, or refuses it (`unreachable`), or never answers
    (`hang`: the request stays open until cancelled)."""

    def __init__(self, body: bytes = b'{"ok": true}', *, unreachable: bool = False,
                 hang: bool = False) -> None:
        self.body = body
        self.unreachable = unreachable
        self.hang = hang
        self.paths: list[str] = []
        self.cancelled = False

    async def open(self, method: str, path: str, headers: RawHeaders, body: bytes, *,
                   stream: bool) -> UpstreamResponse:
        self.paths.append(path)
        if self.unreachable:
            raise UpstreamUnreachable("connection refused")
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return Answer(self.body, [(b"content-type", b"application/json"),
                                  (b"server", b"sglang"), (b"content-length", b"999")])

    async def aclose(self) -> None:
        pass


def make_app(router: ListRouter, e0: FakeBackend, b0: FakeBackend,
             **more: FakeBackend) -> SpecRouterApp:
    """The app over `router`; `more` are upstreams of the router's further backends."""
    settings = load_settings(environ={}, overrides={"backends": [
        {"name": b.name, "url": b.url, "pool": b.pool, "group": b.group}
        for b in router.backends]})
    return create_app(settings, router, {"e0": e0, "b0": b0, **more})


async def call(app: ASGIApp, method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with loopback.async_client(transport=transport, base_url="http://router") as client:
        return await client.request(method, path, **kwargs)


@pytest.mark.parametrize("path", sorted(GENERATION_PATHS))
def test_generation_routes_are_proxied_with_our_headers(path: str) -> None:
    router, e0 = ListRouter(), FakeBackend()
    app = make_app(router, e0, FakeBackend())
    response = asyncio.run(call(app, "POST", path, json=CHAT))
    assert response.status_code == 200 and response.json() == {"ok": True}
    assert e0.paths == [path]
    assert response.headers["x-specrouter-backend"] == "e0"
    assert response.headers["content-length"] == str(len(response.content))
    assert "server" not in response.headers
    # Starlette's route table, behind the hot path, routes them as generations too
    assert asyncio.run(call(app.starlette, "POST", path, json=CHAT)).status_code == 200
    assert [(r.model, r.pool) for r in router.requests] == [("m", None), ("m", None)]
    assert router.held == {"e0": 0, "b0": 0}


def test_unreachable_backend_is_retried_on_another() -> None:
    router, e0, b0 = ListRouter(), FakeBackend(unreachable=True), FakeBackend()
    response = asyncio.run(call(make_app(router, e0, b0), "POST", "/v1/completions",
                                json=CHAT))
    assert response.status_code == 200 and response.headers["x-specrouter-backend"] == "b0"
    assert router.outcomes == [("e0", False), ("b0", True)]
    assert [r.exclude for r in router.requests] == [frozenset(), frozenset({"e0"})]
    assert router.held == {"e0": 0, "b0": 0}


def test_a_backend_that_cannot_be_reached_is_retried_in_another_group() -> None:
    # gpu g0's host died: both of its servers refuse connections; g1 is up
    router = ListRouter(backends=(*BACKENDS, Backend("e1", "http://e1", "eagle", "g1")))
    e0, b0, e1 = FakeBackend(unreachable=True), FakeBackend(unreachable=True), FakeBackend()
    response = asyncio.run(call(make_app(router, e0, b0, e1=e1), "POST", "/v1/completions",
                                json=CHAT))
    assert response.status_code == 200 and response.headers["x-specrouter-backend"] == "e1"
    assert [r.exclude for r in router.requests] == [frozenset(), frozenset({"e0", "b0"})]
    assert b0.paths == [] and router.held == {"e0": 0, "b0": 0, "e1": 0}


def test_a_recall_before_the_first_byte_routes_the_request_again() -> None:
    router, e0, b0 = ListRouter(recall_first=True), FakeBackend(hang=True), FakeBackend()
    response = asyncio.run(call(make_app(router, e0, b0), "POST", "/v1/chat/completions",
                                json=CHAT))
    assert response.status_code == 200 and response.headers["x-specrouter-backend"] == "b0"
    assert e0.cancelled  # the upstream request was closed
    assert [r.recalled for r in router.requests] == [False, True]
    assert router.held == {"e0": 0, "b0": 0}


def test_draining_refuses_new_requests_but_answers_health_checks() -> None:
    router, e0 = ListRouter(), FakeBackend()
    app = make_app(router, e0, FakeBackend())
    app.lifecycle.draining = True
    refused = asyncio.run(call(app, "POST", "/v1/chat/completions", json=CHAT))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["connection"] == "close"
    assert asyncio.run(call(app, "GET", "/health")).status_code == 200
    ready = asyncio.run(call(app, "GET", "/ready"))
    assert ready.status_code == 503 and ready.json()["draining"] is True
    assert e0.paths == []


def test_models_are_the_union_of_the_backends_lists() -> None:
    def models(*ids: str) -> bytes:
        return json.dumps({"data": [{"id": i, "object": "model"} for i in ids]}).encode()

    app = make_app(ListRouter(), FakeBackend(models("a", "b")), FakeBackend(models("b", "c")))
    response = asyncio.run(call(app, "GET", "/v1/models"))
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["a", "b", "c"]


class EndlessAnswer:
    """A JSON answer whose body never ends; `closed` once the proxy let go of it."""

    def __init__(self) -> None:
        self.status = 200
        self.headers: RawHeaders = [(b"content-type", b"application/json")]
        self.sent = 0
        self.closed = False

    def divert(self, write: ChunkWriter) -> bool:
        return False  # every chunk through iter_raw, as the httpx transport does

    async def iter_raw(self) -> AsyncIterator[bytes]:
        while not self.closed:
            self.sent += 65536
            yield b"a" * 65536

    async def aclose(self) -> None:
        self.closed = True


class EndlessBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.answer = EndlessAnswer()

    async def open(self, method: str, path: str, headers: RawHeaders, body: RequestBody, *,
                   stream: bool) -> UpstreamResponse:
        return self.answer


class LocalErrorBackend(FakeBackend):
    async def open(self, method: str, path: str, headers: RawHeaders, body: RequestBody, *,
                   stream: bool) -> UpstreamResponse:
        raise UpstreamLocalError("cannot open a connection: [Errno 24] Too many open files")


def limited_app(router: ListRouter, e0: FakeBackend, b0: FakeBackend,
                **limits: int) -> SpecRouterApp:
    settings = load_settings(environ={}, overrides={"limits": limits, "backends": [
        {"name": b.name, "url": b.url, "pool": b.pool, "group": b.group} for b in BACKENDS]})
    return create_app(settings, router, {"e0": e0, "b0": b0})


def test_a_buffered_answer_over_the_limit_is_502_and_the_upstream_is_closed() -> None:
    router, e0 = ListRouter(), EndlessBackend()
    app = limited_app(router, e0, FakeBackend(), max_response_body_bytes=1 << 20)
    response = asyncio.run(call(app, "POST", "/v1/completions", json=CHAT))
    assert response.status_code == 502
    assert "exceeds the router's 1048576 byte limit" in response.json()["error"]["message"]
    assert e0.answer.closed and e0.answer.sent <= (1 << 20) + 65536
    assert router.held == {"e0": 0, "b0": 0}


def test_no_local_descriptor_is_503_and_never_blamed_on_the_backend() -> None:
    router = ListRouter()
    app = make_app(router, LocalErrorBackend(), FakeBackend())
    response = asyncio.run(call(app, "POST", "/v1/chat/completions", json=CHAT))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == "overloaded" and "Too many open files" in error["message"]
    assert router.outcomes == []  # no backend failure recorded, no retry elsewhere
    assert router.held == {"e0": 0, "b0": 0}


def test_request_bodies_held_at_once_are_bounded_then_given_back() -> None:
    router, e0 = ListRouter(), FakeBackend(hang=True)
    app = limited_app(router, e0, FakeBackend(), max_body_bytes=1000,
                      max_inflight_body_bytes=1500)
    big = {**CHAT, "pad": "x" * 800}

    async def scenario() -> None:
        held = asyncio.ensure_future(call(app, "POST", "/v1/chat/completions", json=big))
        while not e0.paths:  # the first request is at its backend, its body held
            await asyncio.sleep(0)
        refused = await call(app, "POST", "/v1/chat/completions", json=big)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert 800 < app.proxy.bodies.held <= 1000
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        assert app.proxy.bodies.held == 0

    asyncio.run(scenario())
