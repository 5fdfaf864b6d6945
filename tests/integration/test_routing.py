"""Load-aware routing end to end: two simulated GPU groups, the router, the openai client.

Load is held by long streaming requests kept open (the simulator runs in real time here,
so a 4000-token request lasts tens of seconds); closing a stream is a client disconnect,
which the router counts out and the engine aborts. `load_signal: inflight` makes the
group loads exact, so the expected decisions can be written down request by request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import openai
import pytest

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.integration.conftest import Cluster, ClusterFactory

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LONG = 4000


@dataclass
class Routed:
    group: str
    pool: str
    backend: str
    reason: str


def _routed(headers: Mapping[str, str]) -> Routed:
    backend = headers["x-specrouter-backend"]
    return Routed(backend.rsplit("-", 1)[0], headers["x-specrouter-pool"], backend,
                  headers["x-specrouter-reason"])


class Streams:
    """Streaming chat requests through the router, held open until closed."""

    def __init__(self, base_url: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none",
                                         max_retries=0, timeout=60.0)
        self.open: list[tuple[Routed, contextlib.AsyncExitStack]] = []

    async def start(self, headers: Mapping[str, str] | None = None) -> Routed:
        stack = contextlib.AsyncExitStack()
        response = await stack.enter_async_context(
            self.client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "tell me a long story"}],
                stream=True, max_tokens=LONG, extra_body={"ignore_eos": True},
                extra_headers=dict(headers or {}),
            )
        )
        routed = _routed(response.headers)
        self.open.append((routed, stack))
        return routed

    async def close_where(self, group: str, count: int) -> None:
        """Close `count` held streams of `group` (client disconnects)."""
        mine = [item for item in self.open if item[0].group == group][:count]
        assert len(mine) == count, f"only {len(mine)} streams open on {group}"
        for item in mine:
            self.open.remove(item)
            await item[1].aclose()

    async def aclose(self) -> None:
        for _, stack in self.open:
            await stack.aclose()
        self.open.clear()
        await self.client.close()


@contextlib.asynccontextmanager
async def streams(cluster: Cluster) -> AsyncIterator[Streams]:
    held = Streams(cluster.url)
    try:
        yield held
    finally:
        await held.aclose()


def _group_inflight(cluster: Cluster, group: str) -> int:
    return sum(b["inflight"] for b in cluster.ready()["backends"] if b["group"] == group)


async def _wait_inflight(cluster: Cluster, group: str, expected: int) -> None:
    # The router counts a disconnect out when it notices it: wait for that, off the loop.
    await asyncio.to_thread(wait_until, lambda: _group_inflight(cluster, group) == expected,
                            10.0, f"{group} in-flight == {expected}")


def test_requests_arriving_together_at_a_fresh_router_spread_over_the_groups(
        cluster: ClusterFactory) -> None:
    """A fresh router holds no idle upstream connection, so the callback path hands each
    new request to the app's task with the target it chose. That target counts in flight
    from the choice on: four requests arriving together see each other and go two to
    each group, instead of three or four to the group that looked idle to each."""
    c = cluster()

    async def together() -> list[Routed]:
        async with streams(c) as held:
            return list(await asyncio.gather(*(held.start() for _ in range(4))))

    routed = asyncio.run(together())
    assert sorted(r.group for r in routed) == ["gpu0", "gpu0", "gpu1", "gpu1"], routed
    metrics = loopback.get(f"{c.url}/metrics", timeout=5.0).text
    assert 'specrouter_callback_fallbacks_total{reason="not_started"} 4.0' in metrics
    c.router.wait_idle()


def test_threshold_switches_with_hysteresis_per_group(cluster: ClusterFactory) -> None:
    # exact in-flight counts: no stream moves once it answers (handovers are
    # tests/integration/test_recall.py's)
    c = cluster(policy={"strategy": "threshold", "switch_up": 4, "switch_down": 1,
                        "load_signal": "inflight"},
                env={"SPECROUTER_ADMISSION__HANDOVER_MAX_TOKENS": "0"})

    async def scenario() -> None:
        async with streams(c) as held:
            ramp = [await held.start() for _ in range(12)]
            for group in ("gpu0", "gpu1"):
                seen = [(r.pool, r.reason) for r in ramp if r.group == group]
                # Group choice keeps the two groups level, so each sees loads 0..5 in turn.
                assert seen == [
                    ("eagle", "below_switch_down"), ("eagle", "below_switch_down"),
                    ("eagle", "hysteresis_hold_eagle"), ("eagle", "hysteresis_hold_eagle"),
                    ("baseline", "above_switch_up"), ("baseline", "above_switch_up"),
                ], (group, seen)
            # In-flight requests stayed where they were sent.
            inflight = {b["name"]: b["inflight"] for b in c.ready()["backends"]}
            assert inflight == {"gpu0-eagle": 4, "gpu0-baseline": 2,
                                "gpu1-eagle": 4, "gpu1-baseline": 2}
            # gpu0 falls into the band: it keeps the baseline (hysteresis) ...
            await held.close_where("gpu0", 3)
            await _wait_inflight(c, "gpu0", 3)
            held_back = await held.start()
            assert (held_back.group, held_back.pool, held_back.reason) == (
                "gpu0", "baseline", "hysteresis_hold_baseline")
            # ... and returns to EAGLE-3 once the load is down to switch_down.
            await held.close_where("gpu0", 3)
            await _wait_inflight(c, "gpu0", 1)
            back = await held.start()
            assert (back.group, back.pool, back.reason) == ("gpu0", "eagle", "below_switch_down")
            # gpu1 never left the baseline meanwhile.
            assert c.policy()["groups"][1]["state"]["pool"] == "baseline"

    asyncio.run(scenario())
    c.router.wait_idle()


def test_overflow_caps_eagle_in_flight(cluster: ClusterFactory) -> None:
    c = cluster(policy={"strategy": "overflow", "eagle_cap": 2, "load_signal": "inflight"})

    async def scenario() -> None:
        async with streams(c) as held:
            ramp = [await held.start() for _ in range(8)]
            for group in ("gpu0", "gpu1"):
                seen = [(r.pool, r.reason) for r in ramp if r.group == group]
                assert seen == [("eagle", "below_eagle_cap")] * 2 + [
                    ("baseline", "eagle_cap_reached")] * 2, (group, seen)
            # A finished EAGLE request frees a slot for the next one.
            await held.close_where("gpu0", 1)
            await _wait_inflight(c, "gpu0", 3)
            nxt = await held.start()
            # The closed stream was gpu0's first, an EAGLE-3 one: a slot is free again.
            assert (nxt.group, nxt.pool, nxt.reason) == ("gpu0", "eagle", "below_eagle_cap")

    asyncio.run(scenario())
    c.router.wait_idle()


def test_engine_telemetry_counts_work_sent_around_the_router(cluster: ClusterFactory) -> None:
    """Requests that bypass the router still load the group, through /v1/loads polls."""
    c = cluster(policy={"strategy": "threshold", "switch_up": 4, "switch_down": 1,
                        "load_signal": "max"})
    direct = c.sim("gpu0").url("eagle")

    async def scenario() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "max_tokens": LONG, "ignore_eos": True, "stream": True}
        async with loopback.async_client(timeout=60.0) as client, contextlib.AsyncExitStack() as st:
            for _ in range(5):
                await st.enter_async_context(
                    client.stream("POST", f"{direct}/v1/chat/completions", json=body))
            await asyncio.to_thread(
                wait_until, lambda: c.policy()["groups"][0]["load"] >= 5, 10.0,
                "gpu0's engine-reported load to reach the router")
            async with streams(c) as held:
                first = await held.start()
                # gpu1 is the less loaded group, although the router sent nothing to gpu0.
                assert first.group == "gpu1" and first.pool == "eagle"
                live = c.policy()
                gpu0 = next(b for b in live["backends"] if b["name"] == "gpu0-eagle")
                assert gpu0["inflight"] == 0 and gpu0["telemetry"]["engine_load"] >= 5
                assert live["groups"][0]["choice"] == "baseline"
                assert live["groups"][0]["reason"] == "above_switch_up"

    asyncio.run(scenario())


def test_forced_modes_and_client_override(cluster: ClusterFactory) -> None:
    c = cluster()
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)

    def ask(header: str | None = None) -> Routed:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-specrouter-pool": header} if header else {})
        assert raw.parse().choices[0].message.content
        return _routed(raw.headers)

    assert (ask().pool, ask().reason) == ("eagle", "online_eagle")
    c.patch(mode="baseline")
    forced = ask()
    assert (forced.pool, forced.reason) == ("baseline", "forced_mode")
    # Overrides are off by default: the header is ignored, even a malformed one.
    assert ask("eagle").pool == "baseline"
    assert ask("nonsense").reason == "forced_mode"
    c.patch(allow_client_override=True)
    override = ask("eagle")
    assert (override.pool, override.reason) == ("eagle", "client_override")
    with pytest.raises(openai.BadRequestError) as err:
        ask("nonsense")
    assert "x-specrouter-pool" in str(err.value)
    c.patch(mode="eagle", allow_client_override=False)
    assert (ask("baseline").pool, ask().reason) == ("eagle", "forced_mode")


def test_route_required_pool_goes_to_the_baseline(cluster: ClusterFactory) -> None:
    """Other /v1 routes need the baseline pool, whatever the policy says."""
    c = cluster(policy={"mode": "eagle"})
    response = loopback.post(f"{c.url}/v1/embeddings", json={"model": MODEL, "input": "x"},
                          timeout=10.0)
    assert response.headers["x-specrouter-pool"] == "baseline"
    assert response.headers["x-specrouter-reason"] == "route_pool"

