"""The shadow probe's body: the routed request, cut short and not streamed."""

from __future__ import annotations

import json

from specrouter.backends import Backend
from specrouter.proxy.shadow import probe_body, probe_targets


def shadow(path: str, request: dict[str, object], tokens: int = 128) -> dict[str, object]:
    body = probe_body(path, json.dumps(request).encode(), tokens)
    assert body is not None
    out: dict[str, object] = json.loads(body)
    return out


def test_chat_request_is_cut_and_not_streamed() -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "fix this bug"}],
               "stream": True, "stream_options": {"include_usage": True}, "n": 3,
               "max_completion_tokens": 4000, "temperature": 0.2, "logprobs": True}
    out = shadow("/v1/chat/completions", request)
    assert out == {"model": "m", "messages": request["messages"], "max_tokens": 128,
                   "temperature": 0.2}


def test_a_shorter_request_keeps_its_own_limit() -> None:
    assert shadow("/v1/completions", {"prompt": "def f(", "max_tokens": 16})["max_tokens"] == 16
    assert shadow("/v1/completions", {"prompt": "x", "max_tokens": None})["max_tokens"] == 128


def test_native_generate_cuts_max_new_tokens() -> None:
    out = shadow("/generate", {"text": "hello", "stream": True,
                               "sampling_params": {"max_new_tokens": 999, "temperature": 0}})
    assert out == {"text": "hello", "sampling_params": {"max_new_tokens": 128, "temperature": 0}}
    assert shadow("/generate", {"text": "hi"})["sampling_params"] == {"max_new_tokens": 128}


def test_a_body_that_is_not_a_json_object_gives_no_probe() -> None:
    assert probe_body("/v1/chat/completions", b"[1, 2]", 128) is None
    assert probe_body("/v1/chat/completions", b"{not json", 128) is None


def test_a_probe_rounds_targets_carry_their_prompts_to_prefill() -> None:
    backend = Backend("g0-b", "http://h:2", "baseline", "g0")
    targets = probe_targets("g0", "baseline", backend, 4, 512)
    assert len(targets) == 4 and len({id(t) for t in targets}) == 4  # each counted apart
    assert {(t.reason, t.prefill_tokens) for t in targets} == {("cost_probe", 512.0)}
