"""Clients that leave at any point of a request, many at once (hypothesis).

Each example runs a batch of raw-socket clients concurrently against one router in front
of one simulated group; each client leaves at its own point: inside the request head,
inside the body, right after the request, after some bytes of the answer (streamed or
not), after a pipelined second request, or not at all. The callback path and the app's
coroutine path both serve such requests (a body over several reads, a pipelined request,
a request finding no idle upstream connection), so the departures reach every stage of
both. Properties, after every batch: the router still answers, nothing is left in flight
(read over HTTP), the engines run nothing of the departed requests (each was aborted by
its rid or finished), and no traceback was logged. The same hold with engines failing,
with a group switching pools (recalls and handovers), with the policy rewritten
mid-traffic, and for every framing of a request body; the clients that stay get a whole
answer or a clear error. The clients are `tests/fixtures/departures.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest import loopback
from tests.drills.conftest import (
    FAST_BREAKER,
    FAST_HEALTH,
    MODEL,
    Outcome,
    assert_alive,
    assert_idle,
    call,
    chat_body,
)
from tests.fixtures.departures import (
    Departure,
    departure_plans,
    leave,
    leave_all,
    request_bytes,
)
from tests.fixtures.procs import eventually, wait_until
from tests.fixtures.router import RoutedGroup, group_backends, start_router, start_sim_group


@contextlib.contextmanager
def _routed_group(env: dict[str, str]) -> Iterator[RoutedGroup]:
    """One simulated group behind a router with `env`, and a short abandoned hold: an
    abort the engine does not acknowledge frees its count within it."""
    started: list[Any] = []
    try:
        sim, eagle, baseline = start_sim_group(started, time_scale=0.05)
        proc = start_router(started, group_backends(eagle, baseline),
                            env={"SPECROUTER_UPSTREAM__ABANDONED_HOLD_S": "1.0", **env})
        yield RoutedGroup(router=proc, eagle_url=eagle, baseline_url=baseline, sim=sim)
    finally:
        for p in reversed(started):
            p.stop()


@pytest.fixture(scope="module", params=["callback-path", "coroutine-path"])
def departures(request: pytest.FixtureRequest) -> Iterator[RoutedGroup]:
    """The router with its callback path (the default), and with every request on the
    app's coroutine path; fast health checks and breakers, so that a failing engine's
    breaker closes again soon."""
    with _routed_group({
        "SPECROUTER_HEALTH": json.dumps(FAST_HEALTH),
        "SPECROUTER_BREAKER": json.dumps(FAST_BREAKER),
        "SPECROUTER_LISTEN__CALLBACK_PATH": str(request.param == "callback-path"),
    }) as group:
        yield group


def _assert_clean(group: RoutedGroup) -> None:
    """The router alive, idle, its engines idle, no traceback logged, and still serving."""
    assert_alive(group.router)
    assert_idle(group.router)
    wait_until(lambda: _engines_idle(group), timeout=15.0,
               what="the engines to run nothing of the departed requests")
    output = group.router.process.output()
    at = output.find("Traceback")
    assert at < 0, output[max(0, at - 1500):at + 5000]
    answer = loopback.post(f"{group.router.url}/v1/chat/completions", timeout=20.0,
                        json={"model": MODEL, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "still there?"}]})
    assert answer.status_code == 200, answer.text[:300]


faults = st.fixed_dictionaries({
    "error_rate": st.sampled_from([0.0, 0.2, 0.5]),
    "error_status": st.sampled_from([500, 502, 503]),
    "cut_stream_after_tokens": st.none() | st.integers(0, 12),
    "added_latency_ms": st.sampled_from([0.0, 5.0, 40.0]),
})
_NO_FAULTS = {"error_rate": 0.0, "cut_stream_after_tokens": None, "added_latency_ms": 0.0}


def _backends_healthy(group: RoutedGroup) -> bool:
    return all(b["healthy"] for b in group.router.ready()["backends"])


def _engines_idle(group: RoutedGroup) -> bool:
    return all(group.state(pool)["running"] == 0 and group.state(pool)["waiting"] == 0
               for pool in ("eagle", "baseline"))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(batch=st.lists(departure_plans, min_size=4, max_size=24))
def test_clients_leaving_anywhere_leave_nothing_behind(departures: RoutedGroup,
                                                       batch: list[Departure]) -> None:
    port = int(departures.router.url.rsplit(":", 1)[1])

    asyncio.run(leave_all([port], batch, timeout=30.0))
    _assert_clean(departures)


def test_a_client_leaving_a_stream_with_a_request_pipelined_behind_it(
        departures: RoutedGroup) -> None:
    """uvicorn marks only the last request it parsed disconnected: the stream still
    responding ahead of it must learn of the departure too, not write to a closed
    transport (uvloop raises there)."""
    port = int(departures.router.url.rsplit(":", 1)[1])
    stream = Departure("pipelined", leave_at=300, stream=True, max_tokens=200)
    asyncio.run(leave(port, stream))
    _assert_clean(departures)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(eagle=faults, baseline=faults, batch=st.lists(departure_plans, min_size=2, max_size=16),
       readers=st.integers(1, 8), stream=st.booleans())
def test_failing_engines_and_leaving_clients_together(
        departures: RoutedGroup, eagle: dict[str, Any], baseline: dict[str, Any],
        batch: list[Departure], readers: int, stream: bool) -> None:
    """Engines that answer 5xx, cut streams or answer late while clients leave: every
    client that stays gets a whole answer or a clear error (`call`: an OpenAI error body
    or an SSE error event, never a bare cut or a hang), and nothing is left behind."""
    port = int(departures.router.url.rsplit(":", 1)[1])
    url = f"{departures.router.url}/v1/chat/completions"

    async def run() -> None:
        async with asyncio.timeout(60.0), loopback.async_client(timeout=30.0) as client:
            stayers = [call(client, url, chat_body(max_tokens=16, stream=stream))
                       for _ in range(readers)]
            await asyncio.gather(*stayers, *(leave(port, plan) for plan in batch))

    departures.control("eagle", **eagle)
    departures.control("baseline", **baseline)
    try:
        asyncio.run(run())
    finally:
        departures.control("eagle", **_NO_FAULTS)
        departures.control("baseline", **_NO_FAULTS)
    wait_until(lambda: _backends_healthy(departures), timeout=30.0,
               what="the breakers to close again")
    _assert_clean(departures)


@pytest.fixture(scope="module")
def switching() -> Iterator[RoutedGroup]:
    """A group that switches pools with every few requests (the threshold strategy at
    exact in-flight counts: EAGLE-3 at 0-1 in flight, the baseline from 2 on), so streams
    are recalled before their first byte and handed over after it."""
    policy = {"strategy": "threshold", "switch_up": 2, "switch_down": 0,
              "load_signal": "inflight"}
    with _routed_group({"SPECROUTER_POLICY": json.dumps(policy),
                        "SPECROUTER_ADMISSION__ARRIVAL_WINDOW_MS": "0"}) as group:
        yield group


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(batch=st.lists(departure_plans, min_size=2, max_size=16), readers=st.integers(2, 10),
       tokens=st.integers(4, 60))
def test_switching_groups_and_leaving_clients_together(
        switching: RoutedGroup, batch: list[Departure], readers: int, tokens: int) -> None:
    """Streams recalled and handed over between the pools while other clients leave:
    every client that stays gets a whole answer or a clear error, nothing is left."""
    port = int(switching.router.url.rsplit(":", 1)[1])
    url = f"{switching.router.url}/v1/chat/completions"

    async def run() -> list[Outcome]:
        async with asyncio.timeout(60.0), loopback.async_client(timeout=30.0) as client:
            stayers = asyncio.gather(*(call(client, url, chat_body(max_tokens=tokens))
                                       for _ in range(readers)))
            await asyncio.gather(*(leave(port, plan) for plan in batch))
            return list(await stayers)

    outcomes = asyncio.run(run())
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    _assert_clean(switching)


def test_a_handed_over_stream_with_a_request_pipelined_behind_it_learns_its_client_left(
        switching: RoutedGroup) -> None:
    """A stream handed over mid-way goes on through uvicorn's `send`; with a request
    pipelined behind it, uvicorn marks only that one disconnected when the client goes,
    so the router must mark the stream's own cycle, or the continuation writes to the
    closed transport and reads the engine to its end."""
    port = int(switching.router.url.rsplit(":", 1)[1])
    url = f"{switching.router.url}/v1/chat/completions"
    # one answer on EAGLE-3 first: its upstream connection waits idle, so the stream
    # below starts on the callback path
    assert loopback.post(url, json=chat_body(max_tokens=2, stream=False), timeout=20.0).is_success

    async def scenario() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head, body = request_bytes(Departure("pipelined", 0, True, 4000), port)
        writer.write(head + body + head + body)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readuntil(b"\r\n")  # its first event is on its way: past the first byte
        before = switching.counted("specrouter_handovers")
        async with loopback.async_client(timeout=30.0) as client:
            # two more streams take the group to the baseline: the first stream moves
            others = [asyncio.ensure_future(call(client, url, chat_body(max_tokens=8)))
                      for _ in range(2)]
            await eventually(lambda: switching.counted("specrouter_handovers") > before,
                             timeout=10.0, what="the stream to be handed over")
            writer.close()
            assert all(o.ok for o in await asyncio.gather(*others))

    asyncio.run(scenario())
    _assert_clean(switching)


framings = st.fixed_dictionaries({
    "length": st.sampled_from(["exact", "chunked", "short", "long"]),
    "version": st.sampled_from(["1.1", "1.0"]),
    "expect": st.booleans(),
    "splits": st.lists(st.integers(1, 400), max_size=3),
    "stream": st.booleans(),
})


def _framed(port: int, framing: dict[str, Any]) -> tuple[bytes, list[bytes]]:
    """A chat completion's head and its body's writes, framed as `framing` says: an
    exact, chunked, too short (the body runs past the declared length) or too long
    (the client stops before the declared length) body. The connection is not kept
    alive (HTTP/1.1 says `connection: close`), so the answer ends where the router
    closes."""
    body = json.dumps({"model": MODEL, "stream": framing["stream"], "max_tokens": 4,
                       "messages": [{"role": "user", "content": "framed " * 30}]}).encode()
    lines = [f"POST /v1/chat/completions HTTP/{framing['version']}",
             f"host: 127.0.0.1:{port}", "content-type: application/json"]
    if framing["version"] == "1.1":
        lines.append("connection: close")
    if framing["expect"]:
        lines.append("expect: 100-continue")
    declared = {"exact": len(body), "short": len(body) - 7, "long": len(body) + 50}
    if framing["length"] == "chunked":
        lines.append("transfer-encoding: chunked")
        body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    else:
        lines.append(f"content-length: {declared[framing['length']]}")
    cuts = sorted({min(c, len(body)) for c in framing["splits"]})
    parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), [p for p in parts if p]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(framing=framings)
def test_any_framing_of_a_generation_gets_an_answer_or_a_clean_close(
        departures: RoutedGroup, framing: dict[str, Any]) -> None:
    """Exact, chunked, too short and too long bodies, HTTP/1.0 and 1.1,
    `expect: 100-continue`, the body over several writes: the router answers (an OpenAI
    error where the framing is wrong) or closes the connection, and never hangs."""
    port = int(departures.router.url.rsplit(":", 1)[1])
    head, parts = _framed(port, framing)

    async def exchange() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head)
            for part in parts:
                await writer.drain()
                writer.write(part)
            if framing["length"] == "long":
                writer.write_eof()  # the client is done: the declared rest never comes
            await writer.drain()
            async with asyncio.timeout(20.0):
                try:
                    answer = await reader.read()  # to the router's close
                except ConnectionResetError:
                    # closed with the bytes past the declared length unread: TCP resets
                    assert framing["length"] == "short"
                    return
                while answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
                    answer = answer[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
                if framing["length"] in ("exact", "chunked"):  # a well-framed request
                    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
                elif answer:
                    status = int(answer.split(b" ", 2)[1])
                    assert status < 500 or status in (502, 503, 504), answer[:300]
        finally:
            writer.close()

    asyncio.run(exchange())
    _assert_clean(departures)


ADMIN = "departures-admin-token-5e1b"
policies = st.one_of(
    st.fixed_dictionaries({"strategy": st.just("threshold"), "switch_up": st.sampled_from([2, 3]),
                           "switch_down": st.sampled_from([0, 1]),
                           "load_signal": st.sampled_from(["inflight", "max"])}),
    st.fixed_dictionaries({"strategy": st.just("overflow"), "eagle_cap": st.integers(1, 3)}),
    st.fixed_dictionaries({"strategy": st.just("online"),
                           "online_min_dwell_s": st.sampled_from([0.0, 0.5])}),
    st.fixed_dictionaries({"strategy": st.just("goodput"),
                           "goodput_min_dwell_s": st.sampled_from([0.0, 0.5])}),
    st.fixed_dictionaries({"mode": st.sampled_from(["eagle", "baseline", "auto"])}),
)


@pytest.fixture(scope="module")
def administered() -> Iterator[RoutedGroup]:
    """A router whose policy the tests rewrite over `/policy`."""
    with _routed_group({"SPECROUTER_ADMIN_TOKEN": ADMIN,
                        "SPECROUTER_ADMISSION__ARRIVAL_WINDOW_MS": "0"}) as group:
        yield group


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(changes=st.lists(policies, min_size=1, max_size=4),
       batch=st.lists(departure_plans, min_size=2, max_size=12), readers=st.integers(2, 8))
def test_policy_changes_amid_traffic_and_leaving_clients(
        administered: RoutedGroup, changes: list[dict[str, Any]], batch: list[Departure],
        readers: int) -> None:
    """The admin changes the strategy, its parameters and the mode while streams run and
    clients leave: each write is applied, every client that stays gets a whole answer,
    and nothing is left behind."""
    port = int(administered.router.url.rsplit(":", 1)[1])
    url = f"{administered.router.url}/v1/chat/completions"
    auth = {"authorization": f"Bearer {ADMIN}"}

    async def run() -> list[Outcome]:
        async with asyncio.timeout(60.0), loopback.async_client(timeout=30.0) as client:
            stayers = asyncio.gather(*(call(client, url, chat_body(max_tokens=30))
                                       for _ in range(readers)))
            leavers = asyncio.gather(*(leave(port, plan) for plan in batch))
            for change in changes:
                written = await client.put(f"{administered.router.url}/policy", json=change,
                                           headers=auth)
                assert written.status_code == 200, written.text
            await leavers
            return list(await stayers)

    outcomes = asyncio.run(run())
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    _assert_clean(administered)
