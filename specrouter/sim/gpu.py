"""One simulated GPU shared by the engines of a GPU group.

Model: time-slicing. Two SGLang processes on one GPU launch their kernels into separate CUDA
contexts, and the GPU runs one context's kernels at a time; a step of one engine therefore
occupies the whole GPU, and an engine that wants to step while the other one is stepping waits
for it. Each engine thus sees the other's step time added to its own whenever both have work,
and runs at full speed when the other is idle. Reservations are granted in request order, so
two busy engines alternate step by step, as the CUDA scheduler's time slices roughly do.

Time is real time (loop.time()) scaled by `time_scale`: a simulated millisecond lasts
`time_scale` real milliseconds.
"""

from __future__ import annotations

import asyncio


class SimClock:
    """Simulated seconds since start, derived from the event loop's monotonic clock."""

    def __init__(self, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._t0 = asyncio.get_running_loop().time()

    def real(self) -> float:
        return asyncio.get_running_loop().time()

    def sim_now(self) -> float:
        return (self.real() - self._t0) / self.time_scale

    def real_duration(self, sim_ms: float) -> float:
        return sim_ms / 1000.0 * self.time_scale


class SharedGpu:
    """Serialises steps: `reserve` books the GPU from the earliest free instant."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self._busy_until = clock.real()
        self.busy_sim_s = 0.0

    def reserve(self, earliest_real: float, sim_ms: float) -> tuple[float, float]:
        """Book `sim_ms` of GPU time starting no earlier than `earliest_real`; returns the
        real (start, end) of the slot. Starts may lie in the past: an engine that fell behind
        because the event loop was late catches up instead of drifting."""
        start = max(earliest_real, self._busy_until)
        end = start + self.clock.real_duration(sim_ms)
        self._busy_until = end
        self.busy_sim_s += sim_ms / 1000.0
        return start, end
