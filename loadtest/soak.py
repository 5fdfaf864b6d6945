"""Soak: a simulated GPU group behind a router under steady load, watched for leaks.

    python -m loadtest.soak --duration 600 --concurrency 128 --out docs/soak

starts `specrouter sim` and `specrouter serve`, keeps `--concurrency` streaming chat
requests in flight for `--duration` seconds (raw HTTP/1.1 client: little client CPU), and
samples the router process every `--interval` seconds: resident memory, open file
descriptors (/proc/<pid>/fd), the in-flight count it reports on /ready, and the client's
totals. After the load stops it waits for the router to go idle, then writes
`<out>.json` (every sample) and `<out>.md` (the summary table).

What it judges, in the report's `verdict`:
- memory: growth from the end of the warm-up (allocator and pools filled) to the end of
  the run, and the slope of a least-squares fit over the second half, in MiB per minute;
- file descriptors: back to the pre-load count (± slack) once idle keep-alive connections
  timed out, i.e. no descriptor leaked per request;
- in-flight: zero on /ready after the load;
- requests: every one answered (errors listed by kind).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from loadtest import loopback
from loadtest.client import ConnectionPool, encode, stream_request
from loadtest.metrics import RequestResult
from loadtest.procs import Stack, served_model

MIB = 1024 * 1024


@dataclass
class Sample:
    t: float  # seconds since the load began
    rss_mib: float
    fds: int
    inflight: int  # the router's own count (/ready inflight_total)
    ok: int
    failed: int


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 128
    interval_s: float = 5.0
    warmup_s: float = 30.0
    time_scale: float = 0.02
    max_tokens: int = 64
    profile: str = "seed-coding"
    max_growth_mib: float = 32.0
    # Descriptors allowed above the pre-load count once idle. The router keeps idle
    # upstream keep-alive connections (up to upstream.max_idle_per_backend) until the
    # engine closes them (the simulator after 30 s, as its keep-alive timeout says); a
    # leak per request would be thousands, not tens.
    fd_slack: int = 16
    settle_s: float = 45.0


@dataclass
class SoakReport:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    fds_before: int = 0
    fds_after: int = 0
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    slope_mib_per_min: float = 0.0
    inflight_after: int = -1
    ok: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    requests_per_s: float = 0.0
    verdict: dict[str, bool] = field(default_factory=dict)

    @property
    def growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_warm_mib

    @property
    def passed(self) -> bool:
        return all(self.verdict.values())


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / MIB


def router_inflight(url: str) -> int:
    total: int = loopback.get(f"{url}/ready", timeout=5.0).json()["inflight_total"]
    return total


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per minute; 0 for too few points."""
    if len(points) < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


class Load:
    """`concurrency` closed-loop clients of streaming chat requests until `stop` is set."""

    def __init__(self, url: str, model: str, cfg: SoakConfig) -> None:
        self.pool = ConnectionPool(url, timeout=60.0)
        self.model, self.cfg = model, cfg
        self.ok, self.failed = 0, 0
        self.errors: Counter[str] = Counter()
        self.stop = asyncio.Event()

    async def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            body = encode({"model": self.model, "stream": True, "ignore_eos": True,
                           "max_tokens": rng.randint(self.cfg.max_tokens // 4,
                                                     self.cfg.max_tokens),
                           "messages": [{"role": "user", "content": f"soak {rng.random()}"}]})
            result = await stream_request(self.pool, "/v1/chat/completions", body,
                                          RequestResult(start=0.0))
            if result.ok:
                self.ok += 1
            else:
                self.failed += 1
                self.errors[result.error.split(":")[0][:60]] += 1

    async def run(self) -> None:
        try:
            await asyncio.gather(*(self.client(i) for i in range(self.cfg.concurrency)))
        finally:
            self.pool.close()


async def _sample_loop(report: SoakReport, load: Load, pid: int, url: str,
                       began: float) -> None:
    cfg = report.config
    while not load.stop.is_set():
        t = time.monotonic() - began
        inflight = await asyncio.to_thread(router_inflight, url)
        report.samples.append(Sample(round(t, 2), round(rss_mib(pid), 2), open_fds(pid),
                                     inflight, load.ok, load.failed))
        if t >= cfg.duration_s:
            load.stop.set()
            return
        await asyncio.sleep(min(cfg.interval_s, max(0.05, cfg.duration_s - t)))


async def _drive(report: SoakReport, url: str, pid: int, model: str) -> float:
    load = Load(url, model, report.config)
    began = time.monotonic()
    runner = asyncio.ensure_future(load.run())
    await _sample_loop(report, load, pid, url, began)
    await asyncio.wait_for(runner, 120.0)
    report.ok, report.failed, report.errors = load.ok, load.failed, dict(load.errors)
    return time.monotonic() - began


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def run_soak(cfg: SoakConfig) -> SoakReport:
    """Start the sim and the router, soak, judge; everything is stopped afterwards."""
    report = SoakReport(cfg)
    with Stack() as stack:
        sim = stack.sim_group("gpu0", cfg.profile, cfg.time_scale)
        router = stack.router(sim.backends(), env={
            "SPECROUTER_UPSTREAM__MAX_IDLE_PER_BACKEND": "256"})
        pid = router.child.pid
        model = served_model(sim.eagle_url)
        report.fds_before = open_fds(pid)
        elapsed = asyncio.run(_drive(report, router.url, pid, model))
        report.requests_per_s = round((report.ok + report.failed) / elapsed, 1)
        # Idle: nothing in flight; keep-alive connections close after the servers'
        # keep-alive timeout (5 s), so the descriptor count can return to where it began.
        _wait(lambda: router_inflight(router.url) == 0, 30.0)
        report.inflight_after = router_inflight(router.url)
        _wait(lambda: open_fds(pid) <= report.fds_before + cfg.fd_slack, cfg.settle_s)
        report.fds_after = open_fds(pid)
        _judge(report)
    return report


def _judge(report: SoakReport) -> None:
    cfg = report.config
    warm = [s for s in report.samples if s.t >= min(cfg.warmup_s, cfg.duration_s / 3)]
    warm = warm or report.samples
    report.rss_warm_mib = warm[0].rss_mib
    report.rss_end_mib = report.samples[-1].rss_mib
    half = [s for s in report.samples if s.t >= cfg.duration_s / 2]
    report.slope_mib_per_min = round(slope_per_min([(s.t, s.rss_mib) for s in half]), 3)
    report.verdict = {
        "memory_bounded": report.growth_mib <= cfg.max_growth_mib,
        "fds_back_to_baseline": report.fds_after <= report.fds_before + cfg.fd_slack,
        "zero_inflight_after": report.inflight_after == 0,
        "no_failed_requests": report.failed == 0,
        "served_requests": report.ok > 0,
    }


def to_markdown(report: SoakReport, command: str) -> str:
    cfg = report.config
    lines = [
        f"Command: `{command}`",
        "",
        f"- duration {cfg.duration_s:g} s, concurrency {cfg.concurrency}, sim time scale "
        f"{cfg.time_scale:g}, max_tokens {cfg.max_tokens // 4}..{cfg.max_tokens} (streamed)",
        f"- requests: {report.ok} ok, {report.failed} failed ({report.requests_per_s} req/s)"
        + (f"; errors: {report.errors}" if report.errors else ""),
        f"- router RSS: {report.rss_warm_mib:.1f} MiB after warm-up -> "
        f"{report.rss_end_mib:.1f} MiB at the end (growth {report.growth_mib:+.1f} MiB, "
        f"second-half slope {report.slope_mib_per_min:+.3f} MiB/min)",
        f"- router open fds: {report.fds_before} before the load, {report.fds_after} after "
        f"it (idle)",
        f"- router in-flight after the load: {report.inflight_after}",
        f"- verdict: {'PASS' if report.passed else 'FAIL'} "
        f"({', '.join(f'{k}={v}' for k, v in report.verdict.items())})",
        "",
        "| t (s) | RSS (MiB) | open fds | in flight | ok | failed |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    step = max(1, len(report.samples) // 20)
    shown = report.samples[::step]
    if shown[-1] is not report.samples[-1]:
        shown.append(report.samples[-1])
    lines += [f"| {s.t:.0f} | {s.rss_mib:.1f} | {s.fds} | {s.inflight} | {s.ok} | {s.failed} |"
              for s in shown]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SoakConfig()
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--interval", type=float, default=defaults.interval_s,
                        help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=defaults.warmup_s,
                        help="seconds before the memory baseline is taken")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--max-growth-mib", type=float, default=defaults.max_growth_mib)
    parser.add_argument("--out", default="soak-report",
                        help="report path without suffix: writes OUT.json and OUT.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    cfg = SoakConfig(duration_s=args.duration, concurrency=args.concurrency,
                     interval_s=args.interval, warmup_s=args.warmup,
                     time_scale=args.time_scale, max_tokens=args.max_tokens,
                     max_growth_mib=args.max_growth_mib)
    report = run_soak(cfg)
    command = "python -m loadtest.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(f"{args.out}.json", "w", encoding="utf-8") as f:
        json.dump({**asdict(report), "growth_mib": report.growth_mib, "passed": report.passed,
                   "command": command}, f, indent=1)
    markdown = to_markdown(report, command)
    with open(f"{args.out}.md", "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
