"""Bad input gets a clear OpenAI-format error, never a crash or a leaked in-flight count."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from loadtest import loopback
from tests.fixtures.router import RoutedGroup

LIMIT = 4096


@pytest.fixture
def group(routed_group: Callable[..., RoutedGroup]) -> Iterator[RoutedGroup]:
    g = routed_group(router_env={"SPECROUTER_LIMITS__MAX_BODY_BYTES": str(LIMIT)})
    yield g
    assert g.router.process.proc is not None and g.router.process.proc.poll() is None
    g.router.wait_idle()


def assert_openai_error(response: httpx.Response, status: int, text: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text in error["message"], error["message"]


def test_bad_bodies(group: RoutedGroup) -> None:
    url = f"{group.router.url}/v1/chat/completions"
    with loopback.client(timeout=10.0) as http:
        assert_openai_error(http.post(url, content=b"{not json"), 400, "not valid JSON")
        assert_openai_error(http.post(url, content=b"\xff\xfe"), 400, "not valid JSON")
        for lone in (rb'"\ud800"', rb'"\udc00"', rb'"\ud800\n"'):  # half a surrogate pair
            assert_openai_error(http.post(url, content=b'{"prompt": ' + lone + b"}"), 400,
                                "a lone surrogate is no character (at line 1 column")
        pair = rb'"\ud83d\ude00"'  # a whole pair is a character
        answer = http.post(url, content=b'{"model": "m", "max_tokens": 1, "messages": [{"role": '
                           b'"user", "content": ' + pair + b"}]}",
                           headers={"content-type": "application/json"})
        assert answer.status_code == 200, answer.text
        assert_openai_error(http.post(url, content=b"[1, 2]"), 400, "must be a JSON object")
        assert_openai_error(http.post(url, content=b""), 400, "body is empty")
        assert_openai_error(http.post(f"{group.router.url}/generate", content=b"nope"),
                            400, "not valid JSON")
    assert group.state("eagle")["requests"] == 1  # only the pair reached an engine


def test_body_over_the_limit(group: RoutedGroup) -> None:
    url = f"{group.router.url}/v1/completions"
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    with loopback.client(timeout=10.0) as http:
        assert_openai_error(http.post(url, content=big), 413, "exceeds")

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused while reading
            yield big[:1000]
            yield big[1000:]

        assert_openai_error(http.post(url, content=chunks()), 413, "exceeds")
        small = http.post(url, json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200
    assert group.state("eagle")["requests"] == 1


def test_unknown_paths_and_methods(group: RoutedGroup) -> None:
    with loopback.client(timeout=10.0) as http:
        assert_openai_error(http.get(f"{group.router.url}/nope"), 404, "no route for GET /nope")
        assert_openai_error(http.post(f"{group.router.url}/health"), 405, "Method Not Allowed")


def test_counts_track_a_live_stream_and_return_to_zero(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    g = routed_group(time_scale=0.5)  # slow enough to look at the stream while it runs
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with loopback.stream("POST", f"{g.router.url}/v1/chat/completions", json=body,
                      timeout=30.0) as response:
        lines = response.iter_lines()  # keep a reference: a dropped iterator closes the stream
        assert next(lines).startswith("data:")
        assert g.router.inflight() == {"gpu0-eagle": 1, "gpu0-baseline": 0}
        assert g.router.ready()["inflight_total"] == 1
    g.router.wait_idle()
