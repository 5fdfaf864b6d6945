"""Deterministic stand-ins for the tokenizer and the model's output.

No tokenizer ships with the simulator: prompt length is estimated from characters (about four
per token for English and code) and every output token is one pseudo-word. Output depends only
on the seed and the prompt, so the same request gives the same text whatever the load.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

_SYLLABLES = ("ka", "lo", "mi", "ra", "te", "su", "vin", "dor", "pel", "qua", "zen", "bi",
              "nor", "fa", "gu", "shi", "tra", "xo", "we", "ly")
_WORDS = tuple(" " + a + b for a in _SYLLABLES for b in _SYLLABLES)
VOCAB: tuple[str, ...] = (*_WORDS, ".", ",", "\n", " the", " a", " def", " return", " =", "()")


def count_text_tokens(text: str, chars_per_token: float) -> int:
    return max(1, math.ceil(len(text) / chars_per_token)) if text else 0


def chat_prompt_tokens(messages: list[Any], chars_per_token: float) -> int:
    """Chat template overhead: about four tokens of role markers per message plus the
    assistant header, as Llama-3's template adds."""
    total = 1
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        total += 4 + _content_tokens(content, chars_per_token)
    return total + 4


def _content_tokens(content: Any, chars_per_token: float) -> int:
    if isinstance(content, str):
        return count_text_tokens(content, chars_per_token)
    if isinstance(content, list):  # [{"type":"text","text":...}, ...]
        return sum(count_text_tokens(str(part.get("text", "")), chars_per_token)
                   for part in content if isinstance(part, dict))
    return 0


def request_rng(seed: int, prompt_key: str) -> random.Random:
    digest = hashlib.blake2b(f"{seed}\x00{prompt_key}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class WordStream:
    """The output text of one request, produced token by token on demand."""

    __slots__ = ("_rng",)

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def take(self, n: int) -> str:
        choice = self._rng.choice
        return "".join(choice(VOCAB) for _ in range(n))
