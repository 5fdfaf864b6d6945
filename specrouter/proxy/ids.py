"""Fresh request ids and SGLang rids, without a system call per request.

Each process keeps a generator seeded from the operating system's randomness (seeded
again in a forked child, which would otherwise repeat its parent's ids): an id is 128 bits
of it, unique across requests, processes and replicas with the odds of two random
128-bit numbers meeting, and takes no system call (`os.urandom` took one). Ids name
requests in logs, headers and SGLang's abort; they grant nothing, so they are unique, not
secret.
"""

from __future__ import annotations

import os
import random

_source = random.Random()


def _reseed() -> None:
    _source.seed(os.urandom(32))


_reseed()
os.register_at_fork(after_in_child=_reseed)


def fresh_id() -> str:
    """32 hexadecimal digits, fresh for this process."""
    return f"{_source.getrandbits(128):032x}"
