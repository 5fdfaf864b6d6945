"""Affinity keys of a request: a chain of hashes over the leading bytes of its prompt,
and the client's session key.

A multi-turn conversation resends its history: turn n+1's body starts with the bytes of
turn n's prompt (the same messages, serialised the same way) and appends to them. The
prompt is cut into blocks of `block_bytes` counted from the start of its prompt field
(`"messages"`, `"prompt"`, `"text"` or `"input_ids"`, whichever comes first), and block
i's key hashes block i and key i-1, so equal keys mean (up to a hash collision) equal
prompts up to the end of that block. Fields before the prompt field do not count, so a
client that writes `stream` or `max_tokens` first still matches.

Every byte counts: each block's CRC-32 (zlib, over a view of the body: no copy) is
chained into a 64-bit key by `hash`, so prompts that differ in any byte of a block
differ from that block on, as SGLang's radix cache does. Templated prompts that differ
in one file name of equal length therefore share no key past it, and their prefill
estimate (`Target.prefill_tokens`, which the online model's readings are taken net of)
counts them whole. A 120 KB body costs about 60 microseconds, a 5 KB one 2, and the
JSON is never parsed again.

The keys use Python's `hash`, salted per process: they are compared only inside one
router process. Cross-replica agreement goes through the session key (`home_group`).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

#: The client header that names a conversation (any token up to 128 printable bytes).
SESSION_HEADER = "x-session-id"
_MARKER = re.compile(rb'"(?:messages|prompt|text|input_ids)"')
_SCAN = 4096  # the prompt field is looked for in the body's first bytes only


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """The chain of block keys of one prompt and its estimated size in tokens."""

    keys: tuple[int, ...]
    block_tokens: float  # tokens one block stands for
    prompt_tokens: float  # estimated tokens of the whole prompt

    def tokens(self, blocks: int) -> float:
        """Estimated tokens of the first `blocks` blocks."""
        return min(self.prompt_tokens, blocks * self.block_tokens)


def prompt_start(body: bytes | bytearray) -> int:
    """Offset of the prompt field's name in `body`, 0 when none is near the start."""
    found = _MARKER.search(body, 0, _SCAN)  # the leftmost name: one scan, no copy
    return found.start() if found is not None else 0


def prefix_keys(body: bytes | bytearray, block_bytes: int,
                bytes_per_token: float) -> PrefixKeys:
    """The block keys of a generation request's body (none when it is shorter than one
    block: a short prompt is cheap to prefill anywhere)."""
    start = prompt_start(body)
    size = len(body) - start
    if size < block_bytes:
        return PrefixKeys((), block_bytes / bytes_per_token, size / bytes_per_token)
    view = memoryview(body)
    crc32 = zlib.crc32
    keys: list[int] = []
    key = 0
    for end in range(start + block_bytes, len(body) + 1, block_bytes):
        key = hash((key, crc32(view[end - block_bytes:end])))
        keys.append(key)
    return PrefixKeys(tuple(keys), block_bytes / bytes_per_token, size / bytes_per_token)


def session_key(value: str | None) -> str | None:
    """The client's session key if it is a sane token, else None (it is never an error:
    a bad key only loses affinity)."""
    if value and len(value) <= 128 and value.isprintable() and " " not in value:
        return value
    return None


def home_group(session: str, groups: Sequence[str]) -> str | None:
    """The group a session belongs to by rendezvous hashing: the same in every router
    replica for the same set of groups, and only the sessions of a group that leaves
    move when the set changes."""
    if not groups:
        return None
    key = session.encode() + b"\0"
    return max(groups, key=lambda g: hashlib.blake2b(key + g.encode(), digest_size=8).digest())
