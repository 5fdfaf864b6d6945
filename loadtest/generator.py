"""Load shapes: closed-loop concurrency, open-loop Poisson arrivals, phased traces, and
the replay of a fixed open-loop workload (`loadtest.workload`).

Closed loop: N users, each sends its next request when the previous one ends (the load a
batch job or an agent fleet puts on a server). Open loop: requests arrive at random
(Poisson) times whatever the server does, so queues show up as latency, the way
independent users behave. A trace is a list of phases, each one of the two, as data.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from loadtest.client import ConnectionPool, encode, endpoint_path, stream_request
from loadtest.metrics import RequestResult
from loadtest.promptset import Prompt, PromptCycler, RequestShape, build_body
from loadtest.workload import Arrival


@dataclass(frozen=True)
class Phase:
    """One stretch of a trace, in simulated seconds (scaled by the runner)."""

    name: str
    duration_s: float
    concurrency: int | None = None  # closed loop with this many users
    rate: float | None = None  # or open loop: Poisson arrivals per simulated second
    control: dict[str, Any] | None = None  # sent to the simulators at the phase start

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"phase {self.name!r}: give exactly one of concurrency or rate")
        if self.duration_s <= 0:
            raise ValueError(f"phase {self.name!r}: duration_s must be positive")

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Phase:
        known = {"name", "duration_s", "concurrency", "rate", "control"}
        unknown = set(row) - known
        if unknown:
            raise ValueError(f"phase {row.get('name')!r}: unknown fields {sorted(unknown)}")
        return cls(**row)


ControlHook = Callable[[Phase], Awaitable[None]]


@dataclass
class LoadGenerator:
    """Sends shaped requests to one OpenAI-compatible base URL and records them."""

    base_url: str
    shape: RequestShape
    prompts: Sequence[Prompt]
    seed: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True
    time_scale: float = 1.0
    results: list[RequestResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cycler = PromptCycler(list(self.prompts), self.seed)
        self._rng = random.Random(self.seed)
        self._files = random.Random(f"context:{self.seed}")
        self._path = endpoint_path(self.shape.api)
        self._pool: ConnectionPool | None = None
        self._t0 = time.perf_counter()
        self._bar: tqdm[Any] | None = None

    async def __aenter__(self) -> LoadGenerator:
        self._pool = ConnectionPool(self.base_url)
        self._t0 = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._bar is not None:
            self._bar.close()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _progress(self, total: int | None, desc: str) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = tqdm(total=total, desc=desc, unit="req", disable=not self.progress,
                         leave=False, mininterval=0.5)

    async def one(self, phase: str = "", shape: RequestShape | None = None) -> RequestResult:
        """One request of `shape` (default: the generator's), recorded in `results`."""
        assert self._pool is not None, "use `async with LoadGenerator(...)`"
        body = encode(build_body(self._cycler.next(), shape or self.shape, self._context_file()))
        result = RequestResult(start=self.now(), phase=phase)
        self.results.append(result)
        await stream_request(self._pool, self._path, body, result, self.headers)
        if self._bar is not None:
            self._bar.update(1)
        return result

    def _context_file(self) -> str:
        """A source file of this request's own: its padding shares no prefix with any other
        request's (see `loadtest.promptset`), and the same seed names the same files."""
        return f"src/task_{self._files.getrandbits(48):012x}.py"

    async def closed_loop(
        self, concurrency: int, num_requests: int | None = None,
        duration: float | None = None, phase: str = "", think_s: float = 0.0,
    ) -> list[RequestResult]:
        """`concurrency` users until `num_requests` were sent or `duration` (wall s) passed.

        `think_s` > 0: each user pauses a random (exponential, this mean) time between
        requests, so arrivals are not locked to the engine's step boundaries (a new
        request sent the instant the last token of the previous one arrives always
        lands at the same point of a decode step, which makes a small added delay show up
        as whole steps in TTFT).
        """
        if num_requests is None and duration is None:
            raise ValueError("closed_loop needs num_requests or duration")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        first = len(self.results)
        deadline = None if duration is None else self.now() + duration
        sent = 0
        if phase == "" or self._bar is None:
            self._progress(num_requests, phase or f"c={concurrency}")

        async def user() -> None:
            nonlocal sent
            while (num_requests is None or sent < num_requests) and (
                deadline is None or self.now() < deadline
            ):
                sent += 1
                await self.one(phase)
                if think_s > 0:
                    await asyncio.sleep(self._rng.expovariate(1.0 / think_s))

        await asyncio.gather(*(user() for _ in range(concurrency)))
        return self.results[first:]

    async def open_loop(
        self, rate: float, duration: float | None = None, num_requests: int | None = None,
        phase: str = "",
    ) -> list[RequestResult]:
        """Poisson arrivals at `rate` per wall second; waits for all of them to finish."""
        if rate <= 0:
            raise ValueError("rate must be positive")
        if num_requests is None and duration is None:
            raise ValueError("open_loop needs num_requests or duration")
        first = len(self.results)
        if phase == "" or self._bar is None:
            self._progress(num_requests, phase or f"rate={rate:g}/s")
        tasks: list[asyncio.Task[RequestResult]] = []
        start = self.now()
        next_at = start
        while num_requests is None or len(tasks) < num_requests:
            next_at += self._rng.expovariate(rate)
            if duration is not None and next_at >= start + duration:
                break
            delay = next_at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(phase)))
        await asyncio.gather(*tasks)
        return self.results[first:]

    async def replay(self, arrivals: Sequence[Arrival], phase: str = ""
                     ) -> list[RequestResult]:
        """Send each arrival at its time (simulated s, scaled by `time_scale`) with its
        own prompt and output length; waits for all of them to finish.

        The times are fixed in advance, so runs against different servers send the same
        requests at the same moments. A late wake-up sends at once: arrivals never
        drift later than their schedule by more than the event loop's lag.
        """
        first = len(self.results)
        self._progress(len(arrivals), phase or "replay")
        tasks: list[asyncio.Task[RequestResult]] = []
        start = self.now()
        for arrival in arrivals:
            delay = start + arrival.t * self.time_scale - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            shape = replace(self.shape, input_tokens=arrival.input_tokens,
                            output_tokens=arrival.output_tokens)
            tasks.append(asyncio.create_task(self.one(phase, shape)))
        await asyncio.gather(*tasks)
        return self.results[first:]

    async def trace(self, phases: Sequence[Phase],
                    control: ControlHook | None = None) -> list[RequestResult]:
        """Run phases back to back in simulated time (scaled by `time_scale`).

        Closed-loop phases share one set of users: user i sends requests while i is below
        the current phase's concurrency. So going from 8 to 8 users keeps 8 in flight (no
        doubling at the boundary), going down lets the surplus users' last requests
        finish, as real traffic would. Each request is tagged with the phase it began in.
        """
        first = len(self.results)
        self._progress(None, "trace")
        current: list[Phase | None] = [None]
        wake = [asyncio.Event()]
        finished = [False]

        def switch(phase: Phase | None) -> None:
            old, wake[0] = wake[0], asyncio.Event()
            current[0] = phase
            old.set()

        async def user(index: int) -> None:
            while not finished[0]:
                phase = current[0]
                if phase is not None and phase.concurrency is not None \
                        and index < phase.concurrency:
                    await self.one(phase.name)
                else:
                    await wake[0].wait()

        width = max((p.concurrency or 0) for p in phases)
        users = [asyncio.create_task(user(i)) for i in range(width)]
        arrivals: list[asyncio.Task[list[RequestResult]]] = []
        for phase in phases:
            if control is not None and phase.control:
                await control(phase)
            switch(phase)
            wall = phase.duration_s * self.time_scale
            if phase.rate is not None:
                arrivals.append(asyncio.create_task(self.open_loop(
                    phase.rate / self.time_scale, duration=wall, phase=phase.name)))
            await asyncio.sleep(wall)
        finished[0] = True
        switch(None)
        await asyncio.gather(*users, *arrivals)
        return self.results[first:]
