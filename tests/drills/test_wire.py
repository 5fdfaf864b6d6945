"""What crosses the router between a client and a backend that misbehaves: the router's own
headers come only from the router, hop-by-hop headers stop at it, an interim 103 is not
the answer, a stream past its duration limit ends with an error event, and a request the
HTTP parser rejects still gets an OpenAI-format error."""

from __future__ import annotations

import json

from loadtest import loopback
from tests.drills.hostile import Received, fixed
from tests.drills.memory_attacks import routed
from tests.drills.test_abuse import raw_exchange

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BODY = b'{"object":"chat.completion"}'


def answer(*headers: bytes, before: bytes = b"") -> bytes:
    return (before + b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + b"".join(h + b"\r\n" for h in headers)
            + b"content-length: %d\r\n\r\n" % len(BODY) + BODY)


def test_a_backend_cannot_set_the_routers_headers_or_hop_by_hop_ones() -> None:
    script = fixed(answer(b"x-specrouter-pool: evil-pool", b"x-specrouter-backend: evil",
                          b"connection: keep-alive, x-hop", b"x-hop: secret", b"x-end: kept"))
    with routed(script) as (router, _):
        response = loopback.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=10.0)
        assert response.status_code == 200 and response.content == BODY
        assert response.headers["x-specrouter-pool"] in ("eagle", "baseline")
        assert response.headers["x-specrouter-backend"] in ("e", "b")
        assert "x-hop" not in response.headers and response.headers["x-end"] == "kept"
        metrics = loopback.get(f"{router.url}/metrics", timeout=10.0).text
        assert "evil" not in metrics


def test_an_early_hints_answer_is_skipped_for_the_final_one() -> None:
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"
    with routed(fixed(answer(before=hints))) as (router, _):
        response = loopback.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=10.0)
        assert response.status_code == 200 and response.content == BODY
        assert "link" not in response.headers


def _endless_events(_: Received, out: object) -> None:
    import time

    write = out.write  # type: ignore[attr-defined]
    write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
          b"transfer-encoding: chunked\r\n\r\n")
    event = b'data: {"choices": []}\n\n'
    while True:
        write(b"%x\r\n%s\r\n" % (len(event), event))
        out.flush()  # type: ignore[attr-defined]
        time.sleep(0.02)


def test_a_stream_past_its_duration_limit_ends_with_an_error_event() -> None:
    env = {"SPECROUTER_LIMITS__MAX_STREAM_DURATION_S": "1",
           # one recorded failure would open the breaker for the rest of the test
           "SPECROUTER_BREAKER": json.dumps({"failure_threshold": 1, "cooldown_s": 60})}
    with routed(_endless_events, env) as (router, backend):
        with loopback.stream("POST", f"{router.url}/v1/chat/completions", timeout=10.0,
                          json={**CHAT, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "1 s stream limit" in error["message"]
        assert backend.cut.wait(5.0)
        router.wait_idle()
        # The router's own limit says nothing about the backend: no failure is recorded.
        states = router.ready()["backends"]
        assert all(state["breaker"] == "closed" for state in states), states


def test_a_request_the_parser_rejects_gets_an_openai_error() -> None:
    with routed(fixed(answer())) as (router, _):
        raw = raw_exchange(router.port, b"GARBAGE / NOTHTTP\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head, raw
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        ok = loopback.post(f"{router.url}/v1/chat/completions", json=CHAT, timeout=10.0)
        assert ok.status_code == 200
