"""In-process closed-loop sweeps of a profile, without HTTP: the fitting and checking tool
behind the shipped profiles (docs/simulator.md) and the calibration tests.

Clients live in the engine's own event loop and resubmit the moment a request finishes, so
the engine is never idle for a client's sake. Throughput and latency are both counted in
GPU-busy simulated seconds, never in real time: at the default clock a simulated step lasts
microseconds, so event-loop lateness on a loaded host would otherwise be read as GPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass

from specrouter.sim.engine import Engine, SimRequest
from specrouter.sim.gpu import SharedGpu, SimClock
from specrouter.sim.profile import Profile, engine_limits, load_profile
from specrouter.sim.text import WordStream


@dataclass(frozen=True)
class SweepPoint:
    kind: str
    concurrency: int
    throughput_tok_s: float  # total output tokens per simulated second
    mean_latency_s: float  # per request, GPU-busy simulated seconds (queueing included)


async def closed_loop(profile: Profile, kind: str, concurrency: int, *, prompt_tokens: int = 1000,
                      output_tokens: int = 256, rounds: int = 3, time_scale: float = 1e-4,
                      seed: int = 7) -> SweepPoint:
    clock = SimClock(time_scale)
    gpu = SharedGpu(clock)
    limits = engine_limits(profile, kind)
    engine = Engine(f"sweep-{kind}", kind, profile, gpu, seed, limits)
    engine.start()
    latencies: list[float] = []
    warm = asyncio.Event()
    marks: list[tuple[int, float]] = []

    async def client(i: int) -> None:
        for n in range(rounds):
            req = SimRequest(engine.new_rid(), prompt_tokens, output_tokens, output_tokens,
                             WordStream(random.Random(i)), clock.real())
            busy_at_arrival = engine.counters.busy_sim_s
            engine.submit(req)
            while not req.done:
                await req.event.wait()
                req.event.clear()
            if n > 0:
                latencies.append(engine.counters.busy_sim_s - busy_at_arrival)
            if n == 0 and not warm.is_set():
                warm.set()
                marks.append((engine.counters.generated_tokens, engine.counters.busy_sim_s))

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    marks.append((engine.counters.generated_tokens, engine.counters.busy_sim_s))
    await engine.stop()
    (tok0, t0), (tok1, t1) = marks[0], marks[-1]
    return SweepPoint(kind, concurrency, (tok1 - tok0) / (t1 - t0),
                      sum(latencies) / max(1, len(latencies)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="seed-coding")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=256)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    print("conc  baseline_tok/s  eagle_tok/s  ratio  adaptive_tok/s  baseline_lat_s  "
          "eagle_lat_s  adaptive_lat_s")
    for c in (int(x) for x in args.concurrency.split(",")):
        b, e, a = (asyncio.run(closed_loop(profile, kind, c, prompt_tokens=args.prompt_tokens,
                                           output_tokens=args.output_tokens))
                   for kind in ("baseline", "eagle", "adaptive"))
        print(f"{c:>4}  {b.throughput_tok_s:14.1f}  {e.throughput_tok_s:11.1f}  "
              f"{e.throughput_tok_s / b.throughput_tok_s:5.2f}  {a.throughput_tok_s:14.1f}  "
              f"{b.mean_latency_s:14.2f}  {e.mean_latency_s:11.2f}  {a.mean_latency_s:14.2f}")


if __name__ == "__main__":
    main()
