"""Cost probes: one decode step of a pool measured by generations of the router's own.

Pure: the bodies to send, the answers to read and when a pool is due. The I/O is
`proxy/shadow.py` `CostProber`.

A pool the online model (`routing/online.py`) has never read is priced from the other
pool through fixed ratios, and those differ by model and GPU (the baseline's intercept is
EAGLE-3's / 1.35 on H200 Llama-3.1-8B, / 1.8 on seed-coding). A probe reads it instead:
`batch` generations of one output token, then `batch` of `tokens`, sent together to the
pool's server while its whole group is idle. Their mean end-to-end latencies differ by
the decode steps the longer ones ran, so

    step_ms = (e2e_long - e2e_short) / (steps_long - steps_short)

with the prefill and the HTTP overhead cancelled. Steps are output tokens on the
baseline and verify steps on EAGLE-3 (SGLang's `meta_info.spec_verify_ct`). The latency
is SGLang's own `meta_info.e2e_latency` (seconds on the server's clock, which is the
simulator's clock there), else the router's wall time of the exchange.

A step's cost grows with the context it decodes at, by different amounts on the two pools
(on the seed-coding table a baseline step at 30k tokens costs 10% more than at 512 at
batch 1 and 62% at batch 8, an EAGLE-3 step nothing and 17%): a pool read at one context
and compared with a pool read by its telemetry at the traffic's is priced wrong by that
much. So a probe decodes at the traffic's context, the mean prompt of the generations
the router sent the group (`probe_context`; the configured floor before any), and a pool
read only by probes is probed again once the traffic's context has moved
`CONTEXT_RATIO`-fold from the probe's (`context_due`). Every generation of a probe
shares one prefix of that many token ids, unique to the probe, which a warm-up
generation prefills first: each later generation then prefills only its own
`SUFFIX_TOKENS` (SGLang's radix cache holds the prefix), so a probe at 30k tokens
prefills 30k tokens once and not 30k per generation, its round's answers start
together, and the prefill cancels out of the step.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specrouter.backends import Pool

#: SGLang's native generation route: it takes token ids and reports e2e latency.
PROBE_PATH = "/generate"
#: A probe reading weighs this many telemetry windows (SGLang's decode log of 40 steps).
PROBE_WEIGHT = 1.0
#: A pool whose readings weigh less than this (decayed windows) is due for a probe.
DUE_WEIGHT = 0.5
#: Token ids of probe prompts: ordinary vocabulary ids of any tokenizer.
_ID_BASE, _ID_SPAN = 1000, 20000
#: Each generation's own token ids after the probe's shared prefix.
SUFFIX_TOKENS = 8
#: A pool read only by probes is probed again when the traffic's context is this many
#: times longer or shorter than the probe's; a probe at a context this far from the
#: pool's last probe replaces the pool's readings (`OnlineCostModel.observe`).
CONTEXT_RATIO = 2.0
#: A probe's context takes at most this share of the pool's KV pool.
KV_SHARE = 0.5

_salt = itertools.count(1)


def _ids(salt: int, count: int) -> list[int]:
    return [_ID_BASE + (salt * 7919 + i * 104729) % _ID_SPAN for i in range(count)]


def probe_prefix(tokens: int) -> list[int]:
    """A prefix of `tokens` token ids that no other probe sends."""
    return _ids(next(_salt), tokens)


def cost_probe_body(prefix: Sequence[int], max_tokens: int, rid: str, *,
                    suffix: bool = True) -> bytes:
    """A /generate body: the probe's `prefix` (and, with `suffix`, `SUFFIX_TOKENS` ids of
    this generation's own), greedy, exactly `max_tokens` output tokens, SGLang request id
    `rid` (a cancelled probe is aborted by it: SGLang notices a non-streaming client gone
    only at its 4 s poll)."""
    ids = [*prefix, *_ids(next(_salt), SUFFIX_TOKENS)] if suffix else list(prefix)
    body = {"input_ids": ids, "rid": rid,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0.0}}
    return json.dumps(body, separators=(",", ":")).encode()


def probe_context(traffic: float | None, floor: int, ceiling: int,
                  kv_tokens: int | None) -> int:
    """The prompt tokens a probe decodes at: the traffic's mean prompt (`floor` before
    any), between `floor` and `ceiling`, and within `KV_SHARE` of the pool's KV pool."""
    tokens = floor if traffic is None else min(ceiling, max(floor, round(traffic)))
    if kv_tokens:
        tokens = min(tokens, int(KV_SHARE * kv_tokens))
    return max(1, tokens)


def contexts_differ(a: float, b: float) -> bool:
    """Whether two contexts are `CONTEXT_RATIO` or more apart."""
    return max(a, b) >= CONTEXT_RATIO * max(1.0, min(a, b))


def context_due(probed: float | None, traffic: float | None, read_since: int) -> bool:
    """A pool whose only readings since its last probe are the probe's (`read_since`
    telemetry windows: 0) is due again once the traffic's context differs from the
    probe's by `CONTEXT_RATIO`."""
    return (read_since == 0 and probed is not None and traffic is not None
            and contexts_differ(probed, traffic))


@dataclass(frozen=True)
class ProbeAnswer:
    """One probe generation: its end-to-end latency and the decode steps it ran."""

    e2e_ms: float
    steps: float


def parse_answer(raw: bytes, pool: Pool, wall_ms: float) -> ProbeAnswer | None:
    """The answer of a /generate probe (None: not an answer a step can be read from)."""
    try:
        data: Any = json.loads(raw)
    except ValueError:
        return None
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, Mapping):
        return None
    tokens = _number(meta.get("completion_tokens"))
    if tokens is None:
        return None
    e2e_s = _number(meta.get("e2e_latency"))
    e2e_ms = 1000.0 * e2e_s if e2e_s is not None else wall_ms
    if pool == "baseline":
        return ProbeAnswer(e2e_ms, tokens)
    verify = _number(meta.get("spec_verify_ct"))
    if verify is None:
        accept = _number(meta.get("spec_accept_length"))
        # a one-token answer comes from the prefill: SGLang reports no verify step
        verify = tokens / accept if accept else 0.0 if tokens <= 1 else None
    return None if verify is None else ProbeAnswer(e2e_ms, verify)


def step_reading(short: Sequence[ProbeAnswer], long: Sequence[ProbeAnswer]) -> float | None:
    """One decode step's ms from a round of one-token and a round of long probes."""
    if not short or not long:
        return None
    e2e = _mean([a.e2e_ms for a in long]) - _mean([a.e2e_ms for a in short])
    steps = _mean([a.steps for a in long]) - _mean([a.steps for a in short])
    if steps < 1.0 or e2e <= 0:
        return None
    return e2e / steps


def due(weight: float) -> bool:
    """A pool is probed while its readings weigh less than `DUE_WEIGHT`: never read, or
    not read for about a half-life since a probe (the model then rests on its prior
    again; a pool serving traffic keeps its weight up through its telemetry)."""
    return weight < DUE_WEIGHT


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
