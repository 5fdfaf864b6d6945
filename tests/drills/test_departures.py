"""Clients that leave at any point of a request, many at once (hypothesis).

Each example runs a batch of raw-socket clients concurrently against one router in front
of one simulated group; each client leaves at its own point: inside the request head,
inside the body, right after the request, after some bytes of the answer (streamed or
not), after a pipelined second request, or not at all. The callback path and the app's
coroutine path both serve such requests (a body over several reads, a pipelined request,
a request finding no idle upstream connection), so the departures reach every stage of
both. Properties, after every batch: the router still answers, nothing is left in flight
(read over HTTP), the engines run nothing of the departed requests (each was aborted by
its rid or finished), and no traceback was logged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.drills.conftest import MODEL, assert_alive, assert_idle
from tests.fixtures.procs import wait_until
from tests.fixtures.router import RoutedGroup, group_backends, start_router, start_sim_group

#: Where a client leaves (`_Plan.leave_at` counts bytes within that stage).
STAGES = ("head", "body", "sent", "answer", "pipelined", "never")


@dataclass(frozen=True)
class _Plan:
    stage: str
    leave_at: int  # bytes of the head, the body or the answer before leaving
    stream: bool
    max_tokens: int


plans = st.builds(_Plan, st.sampled_from(STAGES), st.integers(0, 4000), st.booleans(),
                  st.integers(1, 40))


def _request(plan: _Plan, port: int, padding: int = 0) -> tuple[bytes, bytes]:
    """(head, body) of one chat completion; `padding` grows the prompt so the body spans
    reads."""
    body = json.dumps({"model": MODEL, "stream": plan.stream, "max_tokens": plan.max_tokens,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": "hi " + "x" * padding}]}
                      ).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    return head, body


async def _client(port: int, plan: _Plan) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head, body = _request(plan, port, padding=plan.leave_at * 40)
        if plan.stage == "head":
            writer.write(head[:plan.leave_at % len(head)])
            await writer.drain()
            return
        if plan.stage == "body":
            writer.write(head + body[:plan.leave_at % len(body)])
            await writer.drain()
            return
        writer.write(head + body)
        if plan.stage == "pipelined":
            writer.write(head + body)
        await writer.drain()
        if plan.stage == "sent":
            return
        if plan.stage == "never":
            await _read_answer(reader, stream=plan.stream)
            return
        read = 0
        while read < plan.leave_at:
            chunk = await reader.read(plan.leave_at - read)
            if not chunk:
                return
            read += len(chunk)
    finally:
        writer.close()


async def _read_answer(reader: asyncio.StreamReader, stream: bool) -> None:
    """Read one whole answer: a chunked stream to its terminator, else to its length."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), head[:200]
    if b"transfer-encoding: chunked" in head.lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    await reader.readexactly(length)


@pytest.fixture(scope="module", params=["callback-path", "coroutine-path"])
def departures(request: pytest.FixtureRequest) -> Iterator[RoutedGroup]:
    """The router with its callback path (the default), and with every request on the
    app's coroutine path."""
    started: list[Any] = []
    try:
        sim, eagle, baseline = start_sim_group(started, time_scale=0.05)
        # a short hold: an abort the engine does not acknowledge frees its count within it
        env = {"SPECROUTER_UPSTREAM__ABANDONED_HOLD_S": "1.0",
               "SPECROUTER_LISTEN__CALLBACK_PATH": str(request.param == "callback-path")}
        proc = start_router(started, group_backends(eagle, baseline), env=env)
        yield RoutedGroup(router=proc, eagle_url=eagle, baseline_url=baseline, sim=sim)
    finally:
        for p in reversed(started):
            p.stop()


def _assert_clean(group: RoutedGroup) -> None:
    """The router alive, idle, its engines idle, no traceback logged, and still serving."""
    assert_alive(group.router)
    assert_idle(group.router)
    wait_until(lambda: _engines_idle(group), timeout=15.0,
               what="the engines to run nothing of the departed requests")
    output = group.router.process.output()
    at = output.find("Traceback")
    assert at < 0, output[max(0, at - 1500):at + 5000]
    answer = httpx.post(f"{group.router.url}/v1/chat/completions", timeout=20.0,
                        json={"model": MODEL, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "still there?"}]})
    assert answer.status_code == 200, answer.text[:300]


def _engines_idle(group: RoutedGroup) -> bool:
    return all(group.state(pool)["running"] == 0 and group.state(pool)["waiting"] == 0
               for pool in ("eagle", "baseline"))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(batch=st.lists(plans, min_size=4, max_size=24))
def test_clients_leaving_anywhere_leave_nothing_behind(departures: RoutedGroup,
                                                       batch: list[_Plan]) -> None:
    port = int(departures.router.url.rsplit(":", 1)[1])

    async def run() -> None:
        async with asyncio.timeout(30.0):
            await asyncio.gather(*(_client(port, plan) for plan in batch))

    asyncio.run(run())
    _assert_clean(departures)


def test_a_client_leaving_a_stream_with_a_request_pipelined_behind_it(
        departures: RoutedGroup) -> None:
    """uvicorn marks only the last request it parsed disconnected: the stream still
    responding ahead of it must learn of the departure too, not write to a closed
    transport (uvloop raises there)."""
    port = int(departures.router.url.rsplit(":", 1)[1])
    stream = _Plan("pipelined", leave_at=300, stream=True, max_tokens=200)
    asyncio.run(_client(port, stream))
    _assert_clean(departures)
