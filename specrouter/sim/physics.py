"""The cost model: how long one engine step takes and how many tokens it yields.

Pure functions of the profile and the batch, so they can be unit-tested and documented
(docs/simulator.md) without running an event loop.
"""

from __future__ import annotations

import bisect
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


def verify_ms(profile: Profile, width: int, batch: int, ctx: float) -> float:
    """One target forward over `width` tokens per request (verify of width-1 draft tokens),
    untimed by time_factor. Between measured widths (target_qN_ms columns) it is linear in
    the width; past the widest it extends the line through the two widest."""
    table = profile.step_table
    widths = sorted(int(c[len("target_q"):-3]) for c in table.columns()
                    if c.startswith("target_q"))
    if width in widths or len(widths) == 1:
        return table.cost(f"target_q{width if width in widths else widths[0]}_ms", batch, ctx)
    i = bisect.bisect_left(widths, width)
    i = min(max(i, 1), len(widths) - 1)
    lo, hi = widths[i - 1], widths[i]
    c_lo = table.cost(f"target_q{lo}_ms", batch, ctx)
    c_hi = table.cost(f"target_q{hi}_ms", batch, ctx)
    return c_lo + (c_hi - c_lo) * (width - lo) / (hi - lo)


def adaptive_step_ms(profile: Profile, batch: int, ctx: float, steps: int) -> float:
    """One decode step of an adaptive-speculation engine drafting `steps` tokens: `steps`
    draft forwards and a verify of width steps + 1. At 0 steps the verify is a plain decode
    (width 1), and the draft model still extends its KV over the new token, one draft
    forward (eagle_worker_v2.py 0.5.23:1469-1498, SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND
    off by default, environ.py:1577)."""
    table = profile.step_table
    draft = table.cost("draft_step_ms", batch, ctx)
    if steps == 0:
        return profile.time_factor * (table.cost("target_q1_ms", batch, ctx) + draft)
    return profile.time_factor * (verify_ms(profile, steps + 1, batch, ctx) + steps * draft)


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

    def with_max_len(self, max_len: int) -> AcceptModel:
        """The same per-position acceptance p over a chain of another length (another
        number of draft steps): the mean follows from p."""
        return AcceptModel(_chain_mean(self.p, max_len), max_len, self.p)

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
