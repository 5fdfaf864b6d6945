"""The instant upstream answers a streamed chat completion at once, directly and through
the router, as the openai client reads it."""

from __future__ import annotations

import openai

from loadtest import loopback
from loadtest.instant_upstream import MODEL
from loadtest.procs import Stack
from tests.fixtures.procs import wait_until


def _stream(base_url: str) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    text, finish = "", None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
            max_tokens=1):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_a_paced_stream_sends_every_token() -> None:
    with Stack() as stack:
        upstream = stack.instant_upstream(chunks=16, gap_ms=2.0)
        assert _stream(upstream.url) == ("a" * 16, "length")


def _telemetry(router_url: str) -> tuple[str | None, str | None]:
    """The router's load source for its one backend, and its accept length's."""
    telemetry = loopback.get(f"{router_url}/policy").json()["backends"][0]["telemetry"]
    return telemetry["source"], telemetry["accept"]["source"]


def test_a_streamed_completion_directly_and_through_the_router() -> None:
    """The router streams through it, reads its load from /v1/loads, one request a poll
    as against SGLang (its poller searches three endpoints where none answers), and the
    EAGLE-3 server's accept length from its /metrics, as SGLang's with --enable-metrics."""
    with Stack() as stack:
        upstream = stack.instant_upstream()
        assert _stream(upstream.url) == ("a", "length")
        router = stack.router([{"name": "instant", "url": upstream.url, "pool": "eagle",
                                "group": "g"}])
        assert _stream(router.url) == ("a", "length")
        assert loopback.get(f"{upstream.url}/v1/models").json()["data"][0]["id"] == MODEL
        wait_until(lambda: _telemetry(router.url) == ("v1_loads", "metrics"),
                   what="the router's poller reading /v1/loads and /metrics")


def test_each_floor_relays_every_token_and_reuses_its_upstream_connection() -> None:
    """The reference relays (`loadtest.floor_proxy`: the peer scenario's two, the protocol
    floor with the router in the loop and the ASGI floor's exchange without uvicorn) carry
    every token of a paced stream, and of a second one on the upstream connection the
    first left idle."""
    from loadtest.ab import RELAYS
    from loadtest.scenarios.peer import floor_starter

    with Stack() as stack:
        upstream = stack.instant_upstream(chunks=16, gap_ms=2.0)
        for name, kind in RELAYS.items():
            url, _ = floor_starter(kind)(stack, upstream.url)
            assert _stream(url) == ("a" * 16, "length"), name
            assert _stream(url) == ("a" * 16, "length"), name
