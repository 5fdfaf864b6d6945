"""The real `openai` client against a simulated group: stream and non-stream, both engines."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from tests.fixtures.sim import SimGroup

MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]


@pytest.fixture
def group(sim_group: Callable[..., SimGroup]) -> SimGroup:
    return sim_group(time_scale=0.02)


@pytest.mark.parametrize("pool", ["eagle", "baseline"])
def test_chat_non_stream(group: SimGroup, pool: str) -> None:
    client = openai.OpenAI(base_url=f"{group.url(pool)}/v1", api_key="unused")
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12,
                                           extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert len(reply.choices[0].message.content or "") > 12


@pytest.mark.parametrize("pool", ["eagle", "baseline"])
def test_chat_stream_with_usage(group: SimGroup, pool: str) -> None:
    client = openai.OpenAI(base_url=f"{group.url(pool)}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_completion_tokens=20, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])  # the finish chunk carries no usage
    assert chunks[-1].usage.completion_tokens == 20
    assert text
    # one chunk per engine step at most (an EAGLE step carries several tokens; a handler
    # that wakes late sends what accumulated in one chunk, as SGLang's tokenizer manager does)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert 1 <= len(content_chunks) <= 20


def test_completions_stream_and_non_stream(group: SimGroup) -> None:
    client = openai.OpenAI(base_url=f"{group.baseline_url}/v1", api_key="unused")
    done = client.completions.create(model="m", prompt="def reverse(xs):", max_tokens=5)
    assert done.object == "text_completion"
    assert done.usage is not None and done.usage.completion_tokens <= 5
    parts = list(client.completions.create(model="m", prompt="def reverse(xs):", max_tokens=5,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == done.choices[0].text
