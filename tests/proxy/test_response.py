"""What the client gets of a backend's headers: never the router's own `x-specrouter-*`
from a backend, never a hop-by-hop header, including those the backend's `connection`
header names."""

from __future__ import annotations

import pytest

from specrouter.backends import Backend
from specrouter.proxy.response import reported_cache, response_headers
from specrouter.routing.router import Target

TARGET = Target("g", "baseline", Backend("b0", "http://b0", "baseline", "g"), "load")


def test_a_backend_cannot_set_the_routers_own_headers() -> None:
    upstream = [(b"X-SpecRouter-Pool", b"evil"), (b"x-specrouter-backend", b"evil"),
                (b"x-specrouter-reason", b"evil"), (b"x-specrouter-anything", b"evil"),
                (b"content-type", b"application/json")]
    headers = response_headers(upstream, TARGET, b"rid", 2)
    assert b"evil" not in b"".join(v for _, v in headers)
    assert dict(headers)[b"x-specrouter-pool"] == b"baseline"
    assert [k for k, _ in headers].count(b"x-specrouter-pool") == 1


def test_headers_the_connection_header_names_are_hop_by_hop() -> None:
    upstream = [(b"Connection", b"keep-alive, X-Secret ,x-trace"), (b"x-secret", b"1"),
                (b"X-Trace", b"2"), (b"x-kept", b"3"), (b"keep-alive", b"timeout=5")]
    names = [k for k, _ in response_headers(upstream, TARGET, b"rid")]
    assert b"x-kept" in names
    assert not {b"connection", b"x-secret", b"x-trace", b"keep-alive"} & set(names)


@pytest.mark.parametrize(("data", "seen"), [
    (b'"usage": {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}}',
     (120, 96)),
    (b'"meta_info":{"prompt_tokens":7,"cached_tokens":0}}\n\ndata: [DONE]\n\n', (7, 0)),
    (b'"usage":{"prompt_tokens":120,"prompt_tokens_details":null}', None),
    (b'"content":"\\"cached_tokens\\": 5 \\"prompt_tokens\\": 6"', None),
    (b'"cached_tokens":12', None),
    (b"", None),
])
def test_reported_cache(data: bytes, seen: tuple[int, int] | None) -> None:
    assert reported_cache(data) == seen
