"""Pieces every scenario shares: running one load shape and watching process CPU."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from loadtest.procs import cpu_seconds
from loadtest.promptset import Prompt

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when present: the load generator shares the cores with what it measures."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)


@dataclass
class CpuWatch:
    """CPU share (cores) each watched process used over a stretch of wall time.

    The simulator keeps its own clock only while it has CPU to spare: a share near 1.0
    core means it fell behind and the numbers measure the host, not the engines.
    """

    pids: dict[str, int]

    def __post_init__(self) -> None:
        self._wall = time.perf_counter()
        self._own = time.process_time()
        self._cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def shares(self) -> dict[str, float]:
        wall = max(1e-9, time.perf_counter() - self._wall)
        out = {name: round((cpu_seconds(pid) - self._cpu[name]) / wall, 3)
               for name, pid in self.pids.items()}
        out["loadgen"] = round((time.process_time() - self._own) / wall, 3)
        return out

    def cpu_used(self, name: str) -> float:
        return cpu_seconds(self.pids[name]) - self._cpu[name]


SATURATED_CPU_SHARE = 0.85


def saturated(shares: dict[str, float]) -> list[str]:
    """Processes that ran near a full core: their timing is suspect."""
    return sorted(name for name, share in shares.items() if share >= SATURATED_CPU_SHARE)


def pick(prompts: Sequence[Prompt], limit: int | None) -> list[Prompt]:
    return list(prompts if limit is None else prompts[:limit])


Progress = Callable[[str], None]
