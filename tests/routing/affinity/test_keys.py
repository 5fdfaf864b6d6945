"""Prompt block keys and session keys (specrouter.routing.affinity.keys)."""

from __future__ import annotations

import json

from specrouter.routing.affinity.keys import (
    home_group,
    prefix_keys,
    prompt_start,
    session_key,
)

BLOCK = 1024


def chat(turns: int, system: str = "You are a coding agent. " * 200, **extra: object) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"turn {i}: " + "fix the parser. " * 60})
        messages.append({"role": "assistant", "content": f"answer {i}: " + "done it. " * 80})
    return json.dumps({**extra, "messages": messages, "model": "m", "stream": True}).encode()


def keys(body: bytes) -> tuple[int, ...]:
    return prefix_keys(body, BLOCK, 4.0).keys


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_later_turn_shares_every_full_block_of_the_earlier_prompt() -> None:
    first, second = chat(2), chat(3)
    k1, k2 = keys(first), keys(second)
    # the earlier body, less its closing fields, is a byte prefix of the later one
    shared = first.index(b'], "model"') - prompt_start(first)
    assert common(k1, k2) == shared // BLOCK
    assert len(k2) > len(k1)


def test_a_different_system_prompt_shares_nothing() -> None:
    assert common(keys(chat(2)), keys(chat(2, system="You review code. " * 300))) == 0


def test_fields_before_the_messages_do_not_count() -> None:
    plain = keys(chat(3))
    assert keys(chat(3, max_tokens=17, stream_options={"include_usage": True})) == plain


def test_an_insertion_early_in_the_history_changes_every_later_key() -> None:
    base = chat(3)
    edited = base.replace(b"turn 0: ", b"turn 0: (edited) ", 1)
    k1, k2 = keys(base), keys(edited)
    cut = (base.index(b"turn 0: ") - prompt_start(base)) // BLOCK
    assert common(k1, k2) == cut


def test_size_and_tokens() -> None:
    body = chat(3)
    k = prefix_keys(body, BLOCK, 4.0)
    size = len(body) - prompt_start(body)
    assert len(k.keys) == size // BLOCK
    assert k.prompt_tokens == size / 4.0
    assert k.tokens(2) == 2 * BLOCK / 4.0
    assert k.tokens(10_000) == k.prompt_tokens


def test_a_prompt_shorter_than_one_block_has_no_keys_but_a_size() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    k = prefix_keys(body, BLOCK, 4.0)
    assert k.keys == ()
    assert k.prompt_tokens == (len(body) - body.index(b'"messages"')) / 4.0


def test_completion_and_generate_prompts_are_keyed_from_their_field() -> None:
    text = "def f(x):\n    return x\n" * 200
    a = json.dumps({"model": "m", "prompt": text}).encode()
    b = json.dumps({"max_tokens": 5, "prompt": text + "more"}).encode()
    assert common(keys(a), keys(b)) == len(keys(a))
    g = json.dumps({"sampling_params": {"max_new_tokens": 3}, "text": text}).encode()
    assert prompt_start(g) == g.index(b'"text"')


def test_one_changed_byte_changes_its_block_and_every_later_key() -> None:
    """Templated prompts: the same text but one file name of the same length."""
    base = chat(3, system="Context (src/file_0017.py): " + "def f(x): return x\n" * 300)
    other = base.replace(b"file_0017", b"file_0023", 1)
    assert len(other) == len(base)
    cut = (base.index(b"file_0017") + 6 - prompt_start(base)) // BLOCK
    assert common(keys(base), keys(other)) == cut


def test_session_keys() -> None:
    assert session_key("agent-42/run:7") == "agent-42/run:7"
    assert session_key(None) is None
    assert session_key("") is None
    assert session_key("has space") is None
    assert session_key("x" * 129) is None
    assert session_key("bad\x01") is None


def test_home_group_is_stable_and_moves_only_the_sessions_of_a_leaving_group() -> None:
    groups = ["gpu0", "gpu1", "gpu2", "gpu3"]
    homes = {f"s{i}": home_group(f"s{i}", groups) for i in range(400)}
    assert homes == {s: home_group(s, list(reversed(groups))) for s in homes}
    counts = {g: sum(1 for h in homes.values() if h == g) for g in groups}
    assert min(counts.values()) > 60  # spread over every group
    fewer = [g for g in groups if g != "gpu2"]
    for s, h in homes.items():
        if h != "gpu2":
            assert home_group(s, fewer) == h
    assert home_group("s1", []) is None


def test_the_prompt_starts_at_the_leftmost_field_name_within_the_scan() -> None:
    both = b'{"model": "m", "text": "a", "messages": [{"role": "user", "content": "b"}]}'
    assert prompt_start(both) == both.index(b'"text"')
    late = b'{"pad": "' + b"x" * 5000 + b'", "messages": []}'
    assert prompt_start(late) == 0  # past the first 4096 bytes: keyed from the start
    assert prompt_start(bytearray(both)) == both.index(b'"text"')
