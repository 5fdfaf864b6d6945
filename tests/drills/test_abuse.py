"""Bad input and abuse against a real router: every one gets a clear answer (an
OpenAI-format error, or the engine's own error passed through), the router never crashes,
slow or greedy clients cannot hold resources, and nothing is left in flight."""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest import loopback
from tests.drills.conftest import (
    ADMIN_TOKEN,
    MODEL,
    Drill,
    DrillFactory,
    assert_alive,
    assert_idle,
    chat_body,
)
from tests.drills.wiretap import Wiretap
from tests.fixtures.procs import wait_until
from tests.fixtures.router import RouterFactory

MAX_BODY, MAX_HEADER, MAX_CONNECTIONS = 65536, 8192, 32
LIMITS = {"max_body_bytes": MAX_BODY, "max_header_bytes": MAX_HEADER, "header_timeout_s": 1.0,
          "body_timeout_s": 1.0, "keep_alive_timeout_s": 1.0, "max_connections": MAX_CONNECTIONS}


@pytest.fixture
def abused(drill: DrillFactory) -> Iterator[Drill]:
    d = drill(env={"SPECROUTER_LIMITS": json.dumps(LIMITS)})
    yield d
    assert_alive(d.router)
    assert_idle(d.router)


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes the connection (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return received


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error: dict[str, object] = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def test_malformed_json_and_invalid_utf8_are_400(abused: Drill) -> None:
    url = f"{abused.url}/v1/chat/completions"
    for body in (b"{", b'{"model": "m", "messages": [}', b"\xff\xfe\xfd",
                 b'{"model": "\xff\xfe", "messages": []}', b"null", b"12"):
        assert_openai_error(loopback.post(url, content=body, timeout=10.0), 400)
    assert abused.sim().state("eagle")["requests"] == 0


def test_wrong_types_get_the_engines_400_passed_through(abused: Drill) -> None:
    url = f"{abused.url}/v1/chat/completions"
    for bad in ({"stream": "maybe"}, {"messages": "not a list"}, {"max_tokens": "lots"},
                {"messages": [{"content": "no role"}]}, {"stream_options": 3}):
        body = {**chat_body(4, stream=False), **bad}
        routed = loopback.post(url, json=body, timeout=10.0)
        direct = loopback.post(f"{abused.sim().eagle_url}/v1/chat/completions", json=body,
                            timeout=10.0)
        assert routed.status_code == direct.status_code == 400, (bad, routed.text)
        assert routed.json() == direct.json()  # SGLang's own error, untouched


def test_model_no_server_has_gets_the_engines_answer(abused: Drill) -> None:
    body = {**chat_body(4, stream=False), "model": "no-such-model/at-all"}
    routed = loopback.post(f"{abused.url}/v1/chat/completions", json=body, timeout=10.0)
    direct = loopback.post(f"{abused.sim().eagle_url}/v1/chat/completions", json=body,
                        timeout=10.0)
    assert routed.status_code == direct.status_code
    assert routed.json().keys() == direct.json().keys()


def test_huge_body_is_413_before_it_is_read_whole(abused: Drill) -> None:
    big = b'{"prompt": "' + b"x" * (MAX_BODY * 4) + b'"}'
    assert_openai_error(loopback.post(f"{abused.url}/v1/completions", content=big,
                                   timeout=10.0), 413)


def test_huge_header_is_431_and_the_router_keeps_serving(abused: Drill) -> None:
    port = abused.router.port
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: "
            + b"a" * (MAX_HEADER * 8) + b"\r\ncontent-length: 2\r\n\r\n{}")
    answer = raw_exchange(port, head)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b'"error"' in answer
    many = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 100) for i in range(200))
    answer = raw_exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    ok = loopback.post(f"{abused.url}/v1/chat/completions", json=chat_body(4, stream=False),
                    headers={"x-fine": "b" * 2000}, timeout=10.0)
    assert ok.status_code == 200


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_slowloris_connections_are_closed_after_the_header_timeout(abused: Drill) -> None:
    proc = abused.router.process.proc
    assert proc is not None
    before = _open_fds(proc.pid)
    idle = [socket.create_connection(("127.0.0.1", abused.router.port)) for _ in range(10)]
    trickle = socket.create_connection(("127.0.0.1", abused.router.port))
    trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
    began = time.monotonic()
    closed_by_server = False
    try:
        while time.monotonic() - began < 10:
            trickle.sendall(b"x")  # one byte of a header at a time, never finishing
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        closed_by_server = True
    assert closed_by_server and time.monotonic() - began < 5.0
    for sock in idle:  # never sent a byte: closed with a 408 too
        sock.settimeout(5.0)
        assert sock.recv(4096).startswith(b"HTTP/1.1 408 ")
        sock.close()
    trickle.close()
    wait_until(lambda: _open_fds(proc.pid) <= before + 2, 10.0, "descriptors released")


def test_a_body_trickled_slowly_gets_408_and_frees_the_request(abused: Drill) -> None:
    with socket.create_connection(("127.0.0.1", abused.router.port), timeout=10.0) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
        began = time.monotonic()
        answer = b""
        try:
            while b"\r\n\r\n" not in answer and time.monotonic() - began < 8:
                sock.sendall(b" ")  # one byte of body at a time, never finishing
                sock.settimeout(0.3)
                try:
                    answer += sock.recv(4096)
                except TimeoutError:
                    continue
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(5.0)
        try:  # the rest of the answer, up to the close (`connection: close`)
            while chunk := sock.recv(4096):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"not received within 1 s" in answer
    assert time.monotonic() - began < 5.0
    assert abused.sim().state("eagle")["requests"] == 0


def test_concurrent_connection_limit_answers_503(abused: Drill) -> None:
    held = [socket.create_connection(("127.0.0.1", abused.router.port))
            for _ in range(MAX_CONNECTIONS)]
    try:
        # The one held connection past the budget gets the 503 once its grace is over:
        # then every held one was accepted, and a new request cannot overtake them.
        ready, _, _ = select.select(held, [], [], 5.0)
        assert ready and ready[0].recv(4096).startswith(b"HTTP/1.1 503 "), ready
        refused = loopback.get(f"{abused.url}/v1/models", timeout=5.0)
        assert assert_openai_error(refused, 503)["code"] == "overloaded"
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: loopback.get(f"{abused.url}/v1/models", timeout=5.0).status_code == 200,
               10.0, "the limit to free up")


def test_request_id_with_control_characters_is_not_reflected(abused: Drill) -> None:
    url = f"{abused.url}/v1/chat/completions"
    for bad in ("evil\tid", "a" * 200, "x y", "é-unicode"):
        response = loopback.post(url, json=chat_body(2, stream=False), timeout=10.0,
                              headers={b"x-request-id": bad.encode("utf-8")})
        rid = response.headers["x-request-id"]
        assert rid != bad and len(rid) == 32 and rid.isalnum(), rid
    # CR inside a header value (response splitting attempt) never reaches the app.
    answer = raw_exchange(abused.router.port,
                          b"GET /health HTTP/1.1\r\nhost: x\r\nx-request-id: a\rset-cookie: "
                          b"evil=1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and b"evil" not in answer, answer
    ok = loopback.post(url, json=chat_body(2, stream=False), headers={"x-request-id": "id-42"},
                    timeout=10.0)
    assert ok.headers["x-request-id"] == "id-42"


def test_unknown_fields_reach_the_backend_byte_for_byte(router: RouterFactory) -> None:
    with Wiretap() as tap:
        r = router([{"name": "e", "url": tap.url, "pool": "eagle", "group": "g"},
                    {"name": "b", "url": f"http://localhost:{tap.port}", "pool": "baseline",
                     "group": "g"}],
                   env={"SPECROUTER_TELEMETRY__ENABLED": "false"})
        body = (b'{ "model" : "m", "messages":[{"role":"user","content":"hi \\u00e9"}],'
                b' "x_vendor": {"nested": [1, 2.50, null]}, "stream": false ,'
                b'"zz_unknown":"\xc3\xa9"}')
        response = loopback.post(f"{r.url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=10.0)
        assert response.status_code == 200, response.text
        forwarded = tap.generation_requests()
        # the router adds one field in front, the attempt's SGLang rid (proxy/abort.py)
        rid = json.loads(forwarded[0].body)["rid"]
        added = b'{"rid":' + json.dumps(rid).encode() + b","
        assert len(forwarded) == 1 and forwarded[0].body == added + body[1:]
        assert forwarded[0].path == "/v1/chat/completions"


def test_admin_writes_tokens_invalid_and_oversized_policies(abused: Drill) -> None:
    url = f"{abused.url}/policy"
    version = loopback.get(url, timeout=5.0).json()["policy"]["version"]
    patch = {"mode": "baseline"}
    assert loopback.patch(url, json=patch, timeout=5.0).status_code == 401
    for token in ("wrong", ADMIN_TOKEN[:-1], ADMIN_TOKEN + "x", "x", ADMIN_TOKEN.upper()):
        response = loopback.patch(url, json=patch, timeout=5.0,
                               headers={"authorization": f"Bearer {token}"})
        assert response.status_code == 401, token
        assert ADMIN_TOKEN not in response.text
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    invalid = loopback.patch(url, json={"mode": "sideways"}, headers=auth, timeout=5.0)
    assert_openai_error(invalid, 422)
    assert loopback.patch(url, content=b"{oops", headers=auth, timeout=5.0).status_code == 400
    huge = {"notes": "x" * (1 << 20)}
    assert_openai_error(loopback.put(url, json=huge, headers=auth, timeout=5.0), 413)
    after = loopback.get(url, timeout=5.0).json()["policy"]
    assert after["version"] == version and after["mode"] != "sideways"  # old one kept
    assert loopback.patch(url, json=patch, headers=auth, timeout=5.0).status_code == 200
    assert loopback.get(url, timeout=5.0).json()["policy"]["mode"] == "baseline"
    assert MODEL  # the policy change did not touch the model routes


def test_a_lax_stream_flag_streams_through_the_router_as_on_the_engine(abused: Drill) -> None:
    """SGLang's request models are lax pydantic: "yes" is True, so router and engine both
    stream it (the router must not wait for a whole body that never comes)."""
    body = {**chat_body(4, stream=False), "stream": "yes"}
    for url in (abused.url, abused.sim().eagle_url):
        with loopback.stream("POST", f"{url}/v1/chat/completions", json=body,
                          timeout=10.0) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", (url, lines)
