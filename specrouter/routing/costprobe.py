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

Every probe prompt is unique token ids, so no probe reuses another's cached prefix.
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

_salt = itertools.count(1)


def cost_probe_body(prompt_tokens: int, max_tokens: int, rid: str) -> bytes:
    """A /generate body: `prompt_tokens` token ids no other probe sends, greedy, exactly
    `max_tokens` output tokens, SGLang request id `rid` (a cancelled probe is aborted by
    it: SGLang notices a non-streaming client gone only at its 4 s poll)."""
    salt = next(_salt)
    ids = [_ID_BASE + (salt * 7919 + i * 104729) % _ID_SPAN for i in range(prompt_tokens)]
    body = {"input_ids": ids, "rid": rid,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0.0}}
    return json.dumps(body, separators=(",", ":")).encode()


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
