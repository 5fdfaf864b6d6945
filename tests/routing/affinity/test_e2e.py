"""End to end over real HTTP: the real `openai` client, the router, two simulated GPU
groups with prefix caches (SGLang's `--enable-cache-report`). A multi-turn session stays
on the backend that holds its prefix although the other group is idler, and from its
second turn the engine reports the resent history as cached tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from loadtest import loopback
from tests.fixtures.router import RouterFactory
from tests.fixtures.sim import SimGroup

SESSION = {"x-session-id": "agent-run-1"}


def test_a_multi_turn_session_stays_on_its_backend_and_its_prefix_is_cached(
    sim_group: Callable[..., SimGroup], router: RouterFactory
) -> None:
    groups = [sim_group(group=g, extra_args=["--enable-cache-report"]) for g in ("g0", "g1")]
    backends: list[dict[str, Any]] = [
        {"name": f"{g.group}-{pool}", "url": g.url(pool), "pool": pool, "group": g.group}
        for g in groups for pool in ("eagle", "baseline")]
    proc = router(backends, env={"SPECROUTER_TELEMETRY__ENABLED": "false"})
    client = openai.OpenAI(base_url=proc.v1, api_key="unused", max_retries=0, timeout=30.0)
    model = str(client.models.list().data[0].id)

    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a coding agent. " * 200},
        {"role": "user", "content": "Repository:\n" + "def f(x):\n    return x + 1\n" * 2000},
    ]
    seen: list[tuple[str, int]] = []
    for turn in range(4):
        hold = None
        if seen:
            # an open stream of the same session keeps its group the busier one: without
            # affinity the turn would go to the idle group
            hold = client.chat.completions.create(
                model=model, messages=messages, max_tokens=4000, stream=True,
                extra_headers=SESSION)
            assert hold.response.headers["x-specrouter-backend"] == seen[-1][0]
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=32, extra_headers=SESSION)
        if hold is not None:
            hold.close()
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        seen.append((raw.headers["x-specrouter-backend"],
                     reply.usage.prompt_tokens_details.cached_tokens or 0))
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": f"Tool output {turn}:\n" + "ok\n" * 300}]

    assert len({backend for backend, _ in seen}) == 1, seen
    # every later turn finds at least the earlier prompt in the engine's cache
    assert all(cached > 10_000 for _, cached in seen[1:]), seen
    stats = loopback.get(f"{proc.url}/policy", timeout=5.0).json()["affinity"]
    assert stats["hits"] >= 3 and stats["sessions"] == 1
    proc.wait_idle()


def test_a_client_streaming_without_usage_gets_none_and_the_router_reads_the_cache_anyway(
    sim_group: Callable[..., SimGroup], router: RouterFactory
) -> None:
    """The proxy asks the engine for each stream's usage event and drops it before a client
    that did not ask: the client's stream is what it would be without the router, and the
    engine's cached-token reports still reach the affinity's retention."""
    group = sim_group(extra_args=["--enable-cache-report"])
    proc = router([{"name": "gpu0-baseline", "url": group.baseline_url, "pool": "baseline",
                    "group": "gpu0"}], env={"SPECROUTER_TELEMETRY__ENABLED": "false"})
    client = openai.OpenAI(base_url=proc.v1, api_key="unused", max_retries=0, timeout=30.0)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Repository:\n" + "def f(x):\n    return x + 1\n" * 500}]
    for _ in range(3):
        chunks = list(client.chat.completions.create(
            model="default", messages=messages, max_tokens=8, stream=True))
        assert chunks and all(c.choices and c.usage is None for c in chunks), chunks
    asked = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage is not None  # asked: it is kept
    retention = loopback.get(f"{proc.url}/policy", timeout=5.0).json()["affinity"]["retention"]
    # a report counts where the index predicted a cached prefix: every turn but the first
    assert retention["gpu0-baseline"]["samples"] == 3, retention
    proc.wait_idle()


def test_the_router_judges_each_servers_streamed_pace_against_the_tpot_objective(
    sim_group: Callable[..., SimGroup], router: RouterFactory
) -> None:
    """With `affinity.tpot_slo_ms` set, every stream's pace (first chunk to end over its
    tokens after the first) reaches the objective: a limit the simulated engine keeps is
    met once enough answers came, and GET /policy shows it."""
    group = sim_group(extra_args=["--enable-cache-report"])
    proc = router([{"name": "gpu0-baseline", "url": group.baseline_url, "pool": "baseline",
                    "group": "gpu0"}],
                  env={"SPECROUTER_TELEMETRY__ENABLED": "false",
                       "SPECROUTER_AFFINITY__TPOT_SLO_MS": "10000"})
    client = openai.OpenAI(base_url=proc.v1, api_key="unused", max_retries=0, timeout=30.0)

    def objective() -> Any:
        return loopback.get(f"{proc.url}/policy", timeout=5.0).json()["affinity"][
            "tpot_objective"]

    assert objective() == {"slo_ms": 10000.0, "backends": {
        "gpu0-baseline": {"answers": 0, "within_share": 0.0, "meets": False}}}
    for n in range(4):
        list(client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"question {n}"}],
            max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
    # a non-stream answer tells nothing of its pace
    client.chat.completions.create(model="default", max_tokens=8,
                                   messages=[{"role": "user", "content": "whole"}])
    proc.wait_idle()
    assert objective()["backends"]["gpu0-baseline"] == {
        "answers": 4, "within_share": 1.0, "meets": True}
