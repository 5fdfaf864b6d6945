"""The bundled coding/agentic prompt set, shaped to a target input length.

Prompt length matters to the engines (prefill cost, KV use), so every request is padded
or trimmed to a target size. There is no tokenizer here (the simulator has none and the
harness must work against any OpenAI-compatible server), so lengths use the common
approximation of 4 characters per token: `target_tokens * CHARS_PER_TOKEN` characters
over all messages. Padding is repository context (source text a coding agent would have
pasted), placed before the last user message's question, so the prompt stays plausible.
Each request can name its own source file (`context_label`): the engines' prefix caches
(SGLang's radix cache, and the simulator's) then share nothing past the messages before
the last, as for single-turn requests that each paste their own code. Without a label
every padded prompt starts with the same context, which a prefix cache serves after the
first request; the multi-turn scenario (`loadtest.agentic`) models shared prefixes itself.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4
PROMPTS_DIR = Path(__file__).parent / "prompts"
DEFAULT_PROMPTS = PROMPTS_DIR / "coding.jsonl"

_CONTEXT_HEADER = "Relevant repository context{label}:\n```python\n"
_CONTEXT_FOOTER = "\n```\n\n"
_CONTEXT_CODE = '''\
class RetryPolicy:
    """How often and how long to retry an idempotent call."""

    def __init__(self, attempts: int = 3, base_delay: float = 0.1) -> None:
        self.attempts = attempts
        self.base_delay = base_delay

    def delays(self) -> list[float]:
        return [self.base_delay * 2 ** i for i in range(self.attempts)]


def load_settings(path: str) -> dict[str, object]:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if "workers" in data and int(data["workers"]) < 1:
        raise ValueError("workers must be at least 1")
    return data


async def fetch_all(client, urls: list[str]) -> list[bytes]:
    results = []
    for url in urls:
        response = await client.get(url, timeout=10.0)
        response.raise_for_status()
        results.append(response.content)
    return results

'''


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    messages: list[dict[str, str]]

    def chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


def load_prompts(path: Path | str = DEFAULT_PROMPTS) -> list[Prompt]:
    """Read a JSONL prompt file: one `{"id", "kind", "messages": [...]}` per line."""
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts.append(Prompt(str(row["id"]), str(row.get("kind", "")),
                                      list(row["messages"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a prompt row ({exc})") from exc
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def shape_messages(prompt: Prompt, input_tokens: int | None,
                   context_label: str = "") -> list[dict[str, str]]:
    """The prompt's messages padded or trimmed to about `input_tokens` tokens.

    None keeps the prompt as written. Trimming cuts the last user message from the
    front of its text (the question usually ends it); padding inserts context before it,
    headed by `context_label` (a file of this request's own) when one is given.
    """
    messages = [dict(m) for m in prompt.messages]
    if input_tokens is None:
        return messages
    target = max(1, input_tokens) * CHARS_PER_TOKEN
    last = messages[-1]
    others = sum(len(m["content"]) for m in messages[:-1])
    room = max(CHARS_PER_TOKEN, target - others)
    content = last["content"]
    if len(content) > room:
        last["content"] = content[len(content) - room:]
    elif len(content) < room:
        last["content"] = _context(room - len(content), context_label) + content
    return messages


def _context(chars: int, label: str) -> str:
    header = _CONTEXT_HEADER.format(label=f" ({label})" if label else "")
    frame = len(header) + len(_CONTEXT_FOOTER)
    if chars <= frame:
        return " " * chars
    body_chars = chars - frame
    repeats = body_chars // len(_CONTEXT_CODE) + 1
    return header + (_CONTEXT_CODE * repeats)[:body_chars] + _CONTEXT_FOOTER


@dataclass(frozen=True)
class RequestShape:
    """What every request of a run looks like: model, lengths and API flavour."""

    model: str
    input_tokens: int | None = 1000
    output_tokens: int = 256
    api: str = "chat"  # chat | completions
    ignore_eos: bool = True


def build_body(prompt: Prompt, shape: RequestShape, context_label: str = "") -> dict[str, Any]:
    """An OpenAI request body that streams and reports usage (padding as in
    `shape_messages`).

    `ignore_eos` (an SGLang/vLLM extension) plus `max_tokens` fixes the output length, so
    runs compare like with like; `stream_options.include_usage` gives the exact number of
    output tokens, since one SSE chunk can carry several tokens (EAGLE-3 accepts several
    per step).
    """
    messages = shape_messages(prompt, shape.input_tokens, context_label)
    body: dict[str, Any] = {
        "model": shape.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": shape.output_tokens,
        "temperature": 0.0,
    }
    if shape.ignore_eos:
        body["ignore_eos"] = True
    if shape.api == "chat":
        body["messages"] = messages
    elif shape.api == "completions":
        body["prompt"] = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)
    else:
        raise ValueError(f"unknown api {shape.api!r}: use chat or completions")
    return body


class PromptCycler:
    """Hands out prompts in a seeded shuffled order, so runs are repeatable."""

    def __init__(self, prompts: list[Prompt], seed: int = 0) -> None:
        self._order = list(prompts)
        random.Random(seed).shuffle(self._order)
        self._next = 0

    def next(self) -> Prompt:
        prompt = self._order[self._next % len(self._order)]
        self._next += 1
        return prompt
