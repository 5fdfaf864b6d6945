"""Both transports against a real loopback backend that misbehaves: interim 1xx answers are
skipped, response heads are bounded in bytes and header count, a stream's duration limit
holds, a large body arrives whole, and a connect that fails for want of a descriptor is
the router's own error (UpstreamLocalError), never the backend's."""

from __future__ import annotations

import asyncio
import resource
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, BinaryIO

import pytest

from specrouter.backends import Backend
from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings
from specrouter.proxy.transports.httpx import HttpxUpstream
from specrouter.proxy.transports.native import NativeUpstream
from specrouter.proxy.upstream import (
    Upstream,
    UpstreamError,
    UpstreamLocalError,
    UpstreamOverLimit,
    UpstreamUnreachable,
)
from tests.drills.hostile import HostileBackend, Received, Script, endless, fixed
from tests.drills.wiretap import BODY, Wiretap

TRANSPORTS = {"native": NativeUpstream, "httpx": HttpxUpstream}
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def upstream(kind: str, url: str, **limits: Any) -> Upstream:
    backend = Backend("b", url, "eagle", "g")
    made: Upstream = TRANSPORTS[kind](backend, TimeoutSettings(connect=2.0, first_byte=5.0),
                                      UpstreamSettings(), LimitSettings(**limits))
    return made


def run(kind: str, script: Script, scenario: Callable[[Upstream], Coroutine[Any, Any, None]],
        **limits: Any) -> HostileBackend:
    with HostileBackend(script) as backend:
        async def main() -> None:
            client = upstream(kind, backend.url, **limits)
            try:
                await scenario(client)
            finally:
                await client.aclose()
        asyncio.run(main())
        return backend


async def body_of(client: Upstream, stream: bool = False) -> tuple[int, dict[bytes, bytes], bytes]:
    response = await client.open("POST", "/v1/completions", [], b"{}", stream=stream)
    try:
        body = b"".join([chunk async for chunk in response.iter_raw()])
        return response.status, {k.lower(): v for k, v in response.headers}, body
    finally:
        await response.aclose()


@pytest.fixture(params=sorted(TRANSPORTS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_an_interim_103_is_skipped_and_the_final_answer_returned(kind: str) -> None:
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"

    async def scenario(client: Upstream) -> None:
        for _ in range(2):  # and the connection stays usable for the next exchange
            status, headers, body = await body_of(client)
            assert (status, body) == (200, b"{}")
            assert b"link" not in headers

    backend = run(kind, fixed(hints + OK), scenario)
    assert len(backend.received) == 2


def test_a_head_with_too_many_headers_is_refused(kind: str) -> None:
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(1000))
    head = b"HTTP/1.1 200 OK\r\n" + many + b"content-length: 2\r\n\r\n{}"

    async def scenario(client: Upstream) -> None:
        with pytest.raises(UpstreamOverLimit, match="more than the router's limit of 100"):
            await body_of(client)

    run(kind, fixed(head), scenario)


def test_a_head_over_the_byte_limit_is_refused(kind: str) -> None:
    head = b"HTTP/1.1 200 OK\r\nx-big: " + b"b" * (80 * 1024) + b"\r\ncontent-length: 2\r\n\r\n{}"

    async def scenario(client: Upstream) -> None:
        with pytest.raises(UpstreamOverLimit, match="65536 byte limit"):
            await body_of(client)

    run(kind, fixed(head), scenario)


def test_a_head_that_never_ends_is_cut_at_the_limit(kind: str) -> None:
    """32 MB of one header would otherwise be buffered whole before the parser returns."""
    async def scenario(client: Upstream) -> None:
        # httpcore refuses it at h11's 100 KiB as a protocol error; ours is the limit
        expected = UpstreamOverLimit if kind == "native" else UpstreamUnreachable
        with pytest.raises(expected):
            await body_of(client)

    backend = run(kind, endless(b"HTTP/1.1 200 OK\r\nx-big: "), scenario)
    assert backend.cut.wait(5.0)  # the router closed the connection


def _slow_events(_: Received, out: BinaryIO) -> None:
    out.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
              b"transfer-encoding: chunked\r\n\r\n")
    event = b'data: {"x": 1}\n\n'
    while True:
        out.write(b"%x\r\n%s\r\n" % (len(event), event))
        out.flush()
        time.sleep(0.01)


def test_a_stream_longer_than_its_limit_is_cut(kind: str) -> None:
    async def scenario(client: Upstream) -> None:
        began = time.monotonic()
        with pytest.raises(UpstreamOverLimit, match=r"0\.5 s stream limit"):
            await body_of(client, stream=True)
        assert 0.4 < time.monotonic() - began < 3.0

    backend = run(kind, _slow_events, scenario, max_stream_duration_s=0.5)
    assert backend.cut.wait(5.0)


def test_a_non_stream_answer_has_no_stream_limit(kind: str) -> None:
    async def scenario(client: Upstream) -> None:
        assert (await body_of(client))[0] == 200

    run(kind, fixed(OK), scenario, max_stream_duration_s=0.5)


def test_a_large_body_arrives_whole(kind: str) -> None:
    body = bytearray(range(256)) * (12 * 1024)  # 3 MiB, written in slices as it drains

    async def scenario(url: str) -> None:
        client = upstream(kind, url)
        try:
            response = await client.open("POST", "/generate", [], body, stream=False)
            assert b"".join([c async for c in response.iter_raw()]) == BODY
            await response.aclose()
        finally:
            await client.aclose()

    with Wiretap() as tap:
        asyncio.run(scenario(tap.url))
        assert tap.requests[0].body == body


@pytest.fixture
def few_descriptors() -> Iterator[list[socket.socket]]:
    """Lower this process's descriptor limit and use up what is left of it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog: list[socket.socket] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        yield hog
    finally:
        for sock in hog:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_no_free_descriptor_is_a_local_error_not_an_unreachable_backend(
    kind: str, few_descriptors: list[socket.socket]
) -> None:
    async def scenario(client: Upstream) -> None:
        try:
            while True:
                few_descriptors.append(socket.socket())
        except OSError:
            pass
        with pytest.raises(UpstreamLocalError, match="Too many open files") as raised:
            await client.open("POST", "/generate", [], b"{}", stream=False)
        assert not isinstance(raised.value, UpstreamUnreachable)
        assert isinstance(raised.value, UpstreamError)

    run(kind, fixed(OK), scenario)
