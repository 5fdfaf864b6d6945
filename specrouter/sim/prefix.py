"""Token prefixes without a tokenizer: a prompt as a chain of hashed blocks.

The simulator estimates token counts from characters (`chars_per_token`), so it has no token
ids to put in a radix tree. Instead a prompt is cut into blocks of `BLOCK_CHARS` characters
(64 tokens at 4 characters per token) and each block gets a key that hashes the block's
text together with the key of the block before it. Two prompts with equal leading text
therefore have equal leading keys, and the key of block i stands for the whole prefix up
to block i: a dict of keys is a prefix tree. Hashing a 30k-token prompt is a few hundred
string hashes (tens of microseconds), not a walk over 30k tokens.

Token counts telescope: a block covering characters [a, b) of a text part holds
ceil(b / cpt) - ceil(a / cpt) tokens, so the blocks of a part add up to exactly the part's
estimate in `text.py` and a prompt's blocks add up to its `prompt_tokens`.

Chat prompts follow the Llama-3 template the token estimate assumes: one block of one token
for the start, per message a 4-token header block keyed by the role, then its text blocks,
then the 4-token header of the assistant's turn. A finished answer extends that chain with
its text blocks, which are exactly the blocks the next turn's prompt has for the same
assistant message: a session's next turn finds its whole previous turn cached, as SGLang's
radix cache does after `cache_finished_req` (the answer's KV stays in the tree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 256  # text characters per block: the match granularity (64 tokens at 4 c/t)
BLOCK_IDS = 64  # token ids per block for prompts given as ids
CHAT_HEADER_TOKENS = 4  # role markers per message, as text.chat_prompt_tokens counts
_START = hash("<|begin_of_text|>")


@dataclass(frozen=True)
class Blocks:
    """A prompt's block keys and the token count of each block.

    `tail` says how an answer extends the chain: for chat, the answer's text starts a new
    message after the last key; for a text prompt, it continues the prompt's text, whose
    last block may be partial (`tail_text`, starting at character `tail_start`)."""

    keys: tuple[int, ...]
    tokens: tuple[int, ...]
    chars_per_token: float
    kind: str  # "chat" | "text" | "ids"
    tail_key: int = 0  # the key before the last, partial block (text) or the last key (chat)
    tail_text: str = ""
    tail_start: int = 0
    tail_tokens_before: int = 0  # tokens of the prompt before the partial block (text)

    @property
    def total(self) -> int:
        return sum(self.tokens)

    def with_output(self, text: str) -> Blocks:
        """The chain of the prompt followed by the answer `text`, as the next prompt of the
        same conversation spells it."""
        if not text or self.kind == "ids":
            return self
        if self.kind == "chat":
            keys, tokens = _text_blocks(self.tail_key, text, 0, self.chars_per_token)
            return Blocks(self.keys + keys, self.tokens + tokens, self.chars_per_token, "chat",
                          self.tail_key)
        # text: redo the partial last block with the answer appended
        n_full = len(self.keys) - (1 if self.tail_text else 0)
        keys, tokens = _text_blocks(self.tail_key, self.tail_text + text, self.tail_start,
                                    self.chars_per_token)
        return Blocks(self.keys[:n_full] + keys, self.tokens[:n_full] + tokens,
                      self.chars_per_token, "text")


def _text_blocks(prev: int, text: str, start: int, cpt: float
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Blocks of `text`, whose first character is character `start` of its part."""
    n = len(text)
    keys: list[int] = []
    append = keys.append
    for a in range(0, n, BLOCK_CHARS):
        prev = hash((prev, text[a:a + BLOCK_CHARS]))
        append(prev)
    if not keys:
        return (), ()
    first = start / cpt
    per = BLOCK_CHARS / cpt
    full = len(keys) - 1
    if per.is_integer() and first.is_integer():  # the usual case: whole tokens per block
        last = math.ceil((start + n) / cpt) - int(first) - int(per) * full
        return tuple(keys), (int(per),) * full + (last,)
    ends = [math.ceil((start + a) / cpt) for a in range(BLOCK_CHARS, n, BLOCK_CHARS)]
    ends.append(math.ceil((start + n) / cpt))
    tokens = [e - b for b, e in zip([math.ceil(first), *ends[:-1]], ends, strict=True)]
    return tuple(keys), tuple(tokens)


def text_prompt(text: str, cpt: float) -> Blocks:
    """A completion or /generate prompt string (count_text_tokens' estimate)."""
    keys, tokens = _text_blocks(_START, text, 0, cpt)
    partial = len(text) % BLOCK_CHARS
    n_full = len(keys) - (1 if partial else 0)
    tail_key = keys[n_full - 1] if n_full else _START
    return Blocks(keys, tokens, cpt, "text", tail_key, text[len(text) - partial:] if partial
                  else "", n_full * BLOCK_CHARS, sum(tokens[:n_full]))


def ids_prompt(ids: list[int]) -> Blocks:
    """A prompt given as token ids: exact, BLOCK_IDS ids per block."""
    keys: list[int] = []
    tokens: list[int] = []
    prev = _START
    for a in range(0, len(ids), BLOCK_IDS):
        piece = tuple(ids[a:a + BLOCK_IDS])
        prev = hash((prev, piece))
        keys.append(prev)
        tokens.append(len(piece))
    return Blocks(tuple(keys), tuple(tokens), 1.0, "ids")


def chat_prompt(messages: list[Any], cpt: float) -> Blocks:
    """A chat prompt as text.chat_prompt_tokens counts it: 1 start token, per message a
    4-token header and its text parts, then the 4-token assistant header."""
    keys: list[int] = [_START]
    tokens: list[int] = [1]
    prev = _START
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        prev = hash((prev, "\x00header", str(role)))
        keys.append(prev)
        tokens.append(CHAT_HEADER_TOKENS)
        content = message.get("content") if isinstance(message, dict) else None
        for part in _parts(content):
            k, t = _text_blocks(prev, part, 0, cpt)
            if k:
                keys.extend(k)
                tokens.extend(t)
                prev = k[-1]
    prev = hash((prev, "\x00header", "assistant"))
    keys.append(prev)
    tokens.append(CHAT_HEADER_TOKENS)
    return Blocks(tuple(keys), tuple(tokens), cpt, "chat", prev)


def _parts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content] if content else []
    if isinstance(content, list):
        return [t for part in content if isinstance(part, dict)
                if (t := str(part.get("text", "")))]
    return []
