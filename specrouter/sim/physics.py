"""The cost model: how long one engine step takes and how many tokens it yields.

Pure functions of the profile and the batch, so they can be unit-tested and documented
(docs/simulator.md) without running an event loop.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from specrouter.sim.profile import Profile


def decode_step_ms(profile: Profile, batch: int, ctx: float) -> float:
    """One plain decode step: one target forward over `batch` requests x 1 token."""
    return profile.time_factor * profile.step_table.cost("target_q1_ms", batch, ctx)


def eagle_step_ms(profile: Profile, batch: int, ctx: float) -> float:
    """One EAGLE-3 step: `steps` draft forwards, then one verify forward over the draft tokens."""
    table = profile.step_table
    verify = table.cost(table.verify_column(profile.draft.num_draft_tokens), batch, ctx)
    draft = table.cost("draft_step_ms", batch, ctx)
    return profile.time_factor * (verify + profile.draft.steps * draft)


def prefill_ms(profile: Profile, tokens: int, eagle: bool) -> float:
    """A prefill chunk: a fixed launch cost plus a per-token cost (prefill is compute-bound, so
    linear in tokens); an EAGLE engine also runs its draft model over the same tokens."""
    cost = profile.prefill_base_ms + profile.prefill_per_token_ms * tokens
    return cost * (1.0 + profile.draft_prefill_factor) if eagle else cost


def max_accept(profile: Profile) -> int:
    """Tokens one verify step can yield: the accepted draft tokens plus the bonus token,
    bounded by the draft tree's depth (steps + 1) and by num_draft_tokens."""
    return max(1, min(profile.draft.steps + 1, profile.draft.num_draft_tokens))


@dataclass(frozen=True)
class AcceptModel:
    """Chain acceptance: each draft position is accepted with probability p, and the first
    rejection ends the run, so a step yields 1 + (accepted prefix) tokens, in 1..max_len.
    p is solved so the mean equals the requested accept length (SGLang's accept_length also
    counts the bonus token)."""

    mean: float
    max_len: int
    p: float

    @classmethod
    def for_mean(cls, mean: float, max_len: int) -> AcceptModel:
        mean = min(max(mean, 1.0), float(max_len))
        return cls(mean, max_len, _solve_p(mean, max_len))

    def sample(self, rng: random.Random) -> int:
        n = 1
        while n < self.max_len and rng.random() < self.p:
            n += 1
        return n


def _chain_mean(p: float, max_len: int) -> float:
    return sum(p**k for k in range(max_len))


def _solve_p(mean: float, max_len: int) -> float:
    if mean >= max_len:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _chain_mean(mid, max_len) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sample_output_length(profile: Profile, rng: random.Random) -> int:
    """Where the model would emit EOS, for requests that do not set ignore_eos."""
    dist = profile.output_length
    if dist.sigma <= 0:
        return max(1, round(dist.median))
    return max(1, round(dist.median * math.exp(rng.gauss(0.0, dist.sigma))))
