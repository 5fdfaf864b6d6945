"""The simulated prefix cache: prompt keys, the radix tree, the engine's physics and what
the HTTP surface reports (SGLang's --enable-cache-report fields, the hit-rate gauge)."""

from __future__ import annotations

import asyncio
import itertools
import random
import re
from collections.abc import Callable
from typing import Any

import openai
import pytest

from loadtest import loopback
from specrouter.sim import prefix, protocol
from specrouter.sim.engine import Engine, HitRateWindow, SimRequest
from specrouter.sim.gpu import SharedGpu, SimClock
from specrouter.sim.profile import EngineDefaults, load_profile
from specrouter.sim.radix import RadixCache
from specrouter.sim.text import WordStream, chat_prompt_tokens, count_text_tokens
from tests.fixtures.sim import SimEngine, SimGroup

SYSTEM = "You are a coding agent. " * 400  # ~2400 tokens of shared system prompt


def _chat(*contents: str) -> list[dict[str, Any]]:
    roles = ("user", "assistant")
    return [{"role": "system", "content": SYSTEM},
            *({"role": roles[i % 2], "content": c} for i, c in enumerate(contents))]


# --- prompt keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("messages", [
    _chat("hi"), _chat("x" * 1000, "y" * 257, "z"),
    [{"role": "user", "content": [{"type": "text", "text": "a" * 700}, {"type": "text"}]}],
    [{"role": "user", "content": None}],
])
def test_chat_blocks_add_up_to_the_prompt_estimate(messages: list[Any]) -> None:
    assert prefix.chat_prompt(messages, 4.0).total == chat_prompt_tokens(messages, 4.0)
    assert prefix.chat_prompt(messages, 3.3).total == chat_prompt_tokens(messages, 3.3)


def test_equal_leading_text_gives_equal_leading_keys() -> None:
    a = prefix.chat_prompt(_chat("fix the bug in parse()"), 4.0)
    b = prefix.chat_prompt(_chat("fix the bug in render()"), 4.0)
    shared = next(i for i, (x, y) in enumerate(zip(a.keys, b.keys, strict=False)) if x != y)
    assert shared >= sum(1 for _ in range(0, len(SYSTEM), prefix.BLOCK_CHARS)) + 2
    assert a.keys[:shared] == b.keys[:shared]


def test_a_finished_turn_is_the_prefix_of_the_next_turn() -> None:
    first = _chat("question one " * 50)
    answer = " ka lo mi" * 300
    turn1 = prefix.chat_prompt(first, 4.0).with_output(answer)
    turn2 = prefix.chat_prompt([*first, {"role": "assistant", "content": answer},
                                {"role": "user", "content": "and now?"}], 4.0)
    assert turn2.keys[:len(turn1.keys)] == turn1.keys
    assert turn2.tokens[:len(turn1.tokens)] == turn1.tokens


def test_a_continued_final_message_extends_the_prompt_it_answers() -> None:
    """SGLang's continue_final_message: the last assistant text follows the generation
    prompt, so the prompt it continues is its prefix."""
    first = _chat("question one " * 50)
    answer = " ka lo mi" * 300
    body = {"messages": [*first, {"role": "assistant", "content": answer}],
            "continue_final_message": True}
    params = protocol.parse_chat(body, 4.0, "m")
    assert params.prompt_tokens == (chat_prompt_tokens(first, 4.0)
                                    + count_text_tokens(answer, 4.0))
    assert params.blocks is not None
    assert params.blocks.keys == prefix.chat_prompt(first, 4.0).with_output(answer).keys
    closed = protocol.parse_chat({**body, "continue_final_message": False}, 4.0, "m")
    assert closed.prompt_tokens == chat_prompt_tokens(body["messages"], 4.0)


def test_text_prompt_continues_through_its_answer() -> None:
    prompt, answer = "p" * 1000, "q" * 600
    grown = prefix.text_prompt(prompt, 4.0).with_output(answer)
    longer = prefix.text_prompt(prompt + answer + "more", 4.0)
    assert grown.total == count_text_tokens(prompt + answer, 4.0)
    full = len(prompt + answer) // prefix.BLOCK_CHARS
    assert longer.keys[:full] == grown.keys[:full]


def test_cache_report_shapes_per_release() -> None:
    assert protocol.cache_details(False, 10, omit_zero=False) is None
    assert protocol.cache_details(True, 0, omit_zero=False) == {"cached_tokens": 0}  # 0.5.23
    assert protocol.cache_details(True, 0, omit_zero=True) is None  # 0.5.10
    assert protocol.cache_details(True, 7, omit_zero=True) == {"cached_tokens": 7}


# --- the radix tree ---------------------------------------------------------------------------

def test_match_splits_and_locked_prefixes_survive_eviction() -> None:
    tree = RadixCache()
    _, added = tree.insert([1, 2, 3, 4], [10, 10, 10, 10], now=1.0)
    assert added == 40 and tree.total_tokens == tree.evictable_tokens == 40
    upper, m = tree.match([1, 2, 9], now=2.0)  # ends inside the node: split after 2 keys
    assert m == 2 and tree.prefix_tokens(upper) == 20
    tree.lock(upper)
    assert tree.protected_tokens == 20 and tree.evictable_tokens == 20
    assert tree.evict(1000) == 20  # only the unlocked tail [3, 4] goes
    assert tree.match([1, 2, 3, 4], now=3.0)[1] == 2
    tree.unlock(upper)
    assert tree.evict(1000) == 20 and tree.total_tokens == 0


def test_eviction_is_least_recently_used_first() -> None:
    tree = RadixCache()
    tree.insert([1, 2], [5, 5], now=1.0)
    tree.insert([1, 3], [5, 5], now=2.0)  # shares block 1, so [1] splits off as a parent
    tree.insert([7], [5], now=3.0)
    tree.match([1, 2], now=4.0)  # [1, 2] is now the most recent
    assert tree.evict(5) == 5
    assert tree.match([1, 3], now=5.0)[1] == 1  # [3] went first
    assert tree.evict(5) == 5
    assert tree.match([7], now=6.0)[1] == 0  # then [7]
    assert tree.match([1, 2], now=7.0)[1] == 2
    assert tree.evicted_tokens == 10


# --- engine physics ---------------------------------------------------------------------------

async def _run_turns(kv_capacity: int, turns: int) -> tuple[Engine, list[int]]:
    profile = load_profile("seed-coding")
    engine = Engine("t-baseline", "baseline", profile, SharedGpu(SimClock(1e-5)), 7,
                    EngineDefaults(256, kv_capacity))
    engine.start()
    cached: list[int] = []
    messages = _chat("start")
    for turn in range(turns):
        blocks = prefix.chat_prompt(messages, 4.0)
        req = SimRequest(engine.new_rid(), blocks.total, 64, 64, WordStream(random.Random(turn)),
                         engine.clock.real(), blocks=blocks)
        engine.submit(req)
        while not req.done:
            await req.event.wait()
            req.event.clear()
        answer = req.words.take(req.generated)
        engine.cache_output(req, answer)
        cached.append(req.cached)
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"turn {turn} " + "diff " * 300}]
    await engine.stop()
    return engine, cached


def test_a_session_prefills_only_what_is_new() -> None:
    engine, cached = asyncio.run(_run_turns(kv_capacity=400_000, turns=4))
    c = engine.counters
    assert cached[0] == 0
    assert all(later > earlier for earlier, later in itertools.pairwise(cached))
    assert c.cached_tokens == sum(cached)
    assert c.prefill_tokens == c.prompt_tokens - c.cached_tokens  # only uncached tokens
    assert engine.cache.total_tokens <= 400_000 and engine.cache.protected_tokens == 0


def test_a_small_pool_evicts_and_misses() -> None:
    engine, cached = asyncio.run(_run_turns(kv_capacity=2000, turns=3))
    assert cached == [0, 0, 0]  # a pool smaller than one prompt keeps nothing between turns
    assert engine.cache.evicted_tokens > 0


# --- over HTTP --------------------------------------------------------------------------------

def _gauge(url: str, name: str) -> float:
    text = loopback.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_cached_tokens_reported_as_sglang_reports_them(
        sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("baseline", time_scale=0.005, extra_args=("--enable-cache-report",))
    client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="none")
    messages = _chat("explain the repository")
    first = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16)
    assert first.usage is not None
    if loopback.get(f"{engine.url}/server_info").json()["version"] == "0.5.10":
        assert first.usage.prompt_tokens_details is None  # 0.5.10 omits a zero count
    else:
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "now fix it"}]
    stream = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details is not None
    hit = usage.prompt_tokens_details.cached_tokens
    assert hit is not None and usage.prompt_tokens - 20 < hit < usage.prompt_tokens
    assert _gauge(engine.url, "sglang:cache_hit_rate") == pytest.approx(
        hit / usage.prompt_tokens, abs=0.01)
    loads = loopback.get(f"{engine.url}/v1/loads").json()["loads"][0]
    assert loads["cache_hit_rate"] == pytest.approx(hit / usage.prompt_tokens, abs=0.01)
    text = "shared context " * 300
    gen = loopback.post(f"{engine.url}/generate", json={
        "text": text + "one", "sampling_params": {"max_new_tokens": 4}}).json()
    assert gen["meta_info"]["cached_tokens"] == 0
    gen = loopback.post(f"{engine.url}/generate", json={
        "text": text + "two", "sampling_params": {"max_new_tokens": 4}}).json()
    shared = len(text + "one") // prefix.BLOCK_CHARS * prefix.BLOCK_CHARS
    assert gen["meta_info"]["cached_tokens"] == shared // 4  # the whole blocks both share
    state = engine.state()
    assert state["cached_tokens"] == hit + shared // 4
    assert state["prefill_tokens"] == state["prompt_tokens"] - state["cached_tokens"]
    loopback.post(f"{engine.url}/flush_cache").raise_for_status()
    assert engine.state()["cache_tokens"] == 0
    gen = loopback.post(f"{engine.url}/generate", json={
        "text": text + "two", "sampling_params": {"max_new_tokens": 4}}).json()
    assert gen["meta_info"]["cached_tokens"] == 0


def test_an_admitted_request_with_a_cached_prefix_still_waits_as_sglang_counts() -> None:
    asyncio.run(_admitted_with_cached_prefix())


async def _admitted_with_cached_prefix() -> None:
    profile = load_profile("seed-coding")
    engine = Engine("t-baseline", "baseline", profile, SharedGpu(SimClock(1e-5)), 7,
                    EngineDefaults(256, 400_000))
    blocks = prefix.chat_prompt(_chat("hello"), 4.0)
    engine.cache.insert(blocks.keys, blocks.tokens, now=0.0)
    req = SimRequest("r1", blocks.total, 8, 8, WordStream(random.Random(1)), 0.0,
                     blocks=blocks)
    engine.submit(req)
    engine._admit()
    assert req.cached == blocks.total - 1 and req.state == "prefill"
    assert engine.num_waiting_as_sglang() == 1  # no prefill chunk has run for it yet
    assert engine.live_snapshot().num_waiting_uncached_tokens == blocks.total  # no hit history
    assert engine.used_tokens() == engine.cache.protected_tokens == blocks.total


def test_hit_rate_window_keeps_fifteen_seconds() -> None:
    window = HitRateWindow()
    window.add(90, 100, now=0.0)
    window.add(0, 100, now=10.0)
    assert window.rate() == pytest.approx(0.45)
    window.add(0, 0, now=15.5)  # the first sample is older than 15 s
    assert window.rate() == 0.0


def test_the_memory_split_of_a_pair_decides_its_hit_rates(
        sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.005, extra_args=(
        "--eagle-max-total-tokens", "2000", "--baseline-max-total-tokens", "900000"))
    hits = {}
    for pool in ("eagle", "baseline"):
        assert loopback.get(f"{group.url(pool)}/server_info").json()["max_total_num_tokens"] == \
            (2000 if pool == "eagle" else 900000)
        messages = _chat("first question")
        for _ in range(2):
            answer = loopback.post(f"{group.url(pool)}/v1/chat/completions", json={
                "model": "m", "messages": messages, "max_tokens": 8}).json()
            messages = [*messages, answer["choices"][0]["message"],
                        {"role": "user", "content": "next"}]
        hits[pool] = group.state(pool)["cached_tokens"]
    assert hits["eagle"] == 0  # a 2000-token pool cannot keep a 2400-token session
    assert hits["baseline"] > 2400
