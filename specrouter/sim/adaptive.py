"""In-engine adaptive speculation as SGLang 0.5.23 `--speculative-adaptive` runs it.

Pure logic, no clock: the engine asks `steps_for_batch(B)` before a decode step and feeds
`on_verify(correct_drafts_per_request, B)` after it. Read from sglang 0.5.23
(`speculative/adaptive_spec_params.py`, `adaptive_runtime_state.py`,
`speculative/eagle_worker_v2.py`, `arg_groups/cuda_graph_hook.py`):

- One slot per batch-size tier of the default config (adaptive_spec_params.py:28-53):
  from batch 1 draft steps {1,3,5,7}, from 8 {0,1,3}, from 32 {0,1}, from 64 {0}. A batch
  is padded to the next captured CUDA-graph batch size first, then routed to the largest
  tier at or below it (:330-349); the spec capture sizes are 1-8, 10-32 by 2, 40-64 by 4,
  72-256 by 8, then by 16 up to max_running_requests (cuda_graph_hook.py:517-532), so a
  batch of 61-63 already pads to 64 and runs without drafting.
- Each slot keeps an EMA (alpha 0.2) of accepted draft tokens per request, not counting
  the bonus token, updated after every verify while its steps are > 0; after 10 warm-up
  batches it re-decides every 5 batches: down while the EMA is at or below
  (lower candidate - 0.5 + down_hysteresis), 0.5 + hysteresis for the zero candidate, else
  up while above (current - 0.5 + up_hysteresis); a slot at 0 steps probes the next
  candidate at its next decision (:153-269).
- The server starts at --speculative-num-steps (the middle of the candidates' union,
  [0,1,3,5,7] -> 3, when unset: speculative_hook.py:1409-1414); a slot whose candidates do
  not hold it starts at its middle candidate. Draft tokens are steps + 1, top-k 1.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# (smallest batch of the tier, candidate steps, up_hysteresis, down_hysteresis)
DEFAULT_TIERS: tuple[tuple[int, tuple[int, ...], float, float], ...] = (
    (1, (1, 3, 5, 7), 0.0, -0.25),
    (8, (0, 1, 3), 0.0, 0.0),
    (32, (0, 1), 0.0, 0.0),
    (64, (0,), 0.0, 0.0),
)
EMA_ALPHA = 0.2
UPDATE_INTERVAL = 5
WARMUP_BATCHES = 10


def spec_capture_batch_sizes(max_bs: int) -> list[int]:
    """CUDA-graph batch sizes an EAGLE server captures (cuda_graph_hook.py:517-532)."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
             *range(272, max_bs + 1, 16)]
    sizes = [b for b in sizes if b <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


@dataclass
class StepSlot:
    """AdaptiveStepSlot: the step count of one batch-size tier."""

    candidates: tuple[int, ...]
    up_hysteresis: float
    down_hysteresis: float
    current: int = 0
    ema: float = 0.0
    batches: int = 0

    @classmethod
    def start(cls, candidates: tuple[int, ...], up: float, down: float,
              initial_steps: int) -> StepSlot:
        steps = (initial_steps if initial_steps in candidates
                 else candidates[len(candidates) // 2])
        return cls(candidates, up, down, steps, float(steps - 1))

    def update(self, correct_drafts: list[int]) -> None:
        if not correct_drafts:
            return
        if self.current > 0:
            mean = sum(correct_drafts) / len(correct_drafts)
            self.ema = (1 - EMA_ALPHA) * self.ema + EMA_ALPHA * mean
        self.batches += 1
        if self.batches <= WARMUP_BATCHES:
            return
        if (self.batches - WARMUP_BATCHES) % UPDATE_INTERVAL == 0:
            self._recompute()

    def _recompute(self) -> None:
        idx = self.candidates.index(self.current)
        if self.current == 0:  # probe the next candidate after a no-drafting interval
            idx = min(idx + 1, len(self.candidates) - 1)
            target = self.candidates[idx]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            self.current = target
            return
        start = idx
        while idx > 0:
            lower = self.candidates[idx - 1]
            threshold = (0.5 if lower == 0 else lower - 0.5) + self.down_hysteresis
            if self.ema <= threshold:
                idx -= 1
            else:
                break
        if idx == start:
            while idx < len(self.candidates) - 1:
                if self.ema > self.candidates[idx] - 0.5 + self.up_hysteresis:
                    idx += 1
                else:
                    break
        self.current = self.candidates[idx]


@dataclass
class AdaptiveSteps:
    """AdaptiveSpeculativeParams: routes a batch size to its tier's slot."""

    max_running_requests: int
    initial_steps: int = 3
    tiers: tuple[tuple[int, tuple[int, ...], float, float], ...] = DEFAULT_TIERS
    slots: dict[int, StepSlot] = field(default_factory=dict)
    _bs: list[int] = field(default_factory=list)
    _capture: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for low, candidates, up, down in self.tiers:
            self.slots[low] = StepSlot.start(candidates, up, down, self.initial_steps)
        self._bs = sorted(self.slots)
        self._capture = spec_capture_batch_sizes(self.max_running_requests)

    @property
    def max_steps(self) -> int:
        return max(c for _, candidates, _, _ in self.tiers for c in candidates)

    def slot(self, batch: int) -> StepSlot:
        i = bisect.bisect_left(self._capture, batch)
        padded = self._capture[i] if i < len(self._capture) else batch
        j = bisect.bisect_right(self._bs, padded) - 1
        return self.slots[self._bs[max(0, j)]]

    def steps_for_batch(self, batch: int) -> int:
        return self.slot(batch).current

    def on_verify(self, correct_drafts: list[int], batch: int) -> None:
        self.slot(batch).update(correct_drafts)
