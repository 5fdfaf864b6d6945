"""Pieces every scenario shares: running one load shape and watching process CPU."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from loadtest import loopback
from loadtest.procs import cpu_times
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
        self._times = {name: cpu_times(pid) for name, pid in self.pids.items()}

    def shares(self) -> dict[str, float]:
        wall = max(1e-9, time.perf_counter() - self._wall)
        out = {name: round(self.cpu_used(name) / wall, 3) for name in self.pids}
        out["loadgen"] = round((time.process_time() - self._own) / wall, 3)
        return out

    def times_used(self, name: str) -> tuple[float, float]:
        """User and system CPU seconds `name` used since the watch began."""
        (user, system), (user0, system0) = cpu_times(self.pids[name]), self._times[name]
        return user - user0, system - system0

    def cpu_used(self, name: str) -> float:
        return sum(self.times_used(name))


SATURATED_CPU_SHARE = 0.85


def saturated(shares: dict[str, float]) -> list[str]:
    """Processes that ran near a full core: their timing is suspect."""
    return sorted(name for name, share in shares.items() if share >= SATURATED_CPU_SHARE)


def pick(prompts: Sequence[Prompt], limit: int | None) -> list[Prompt]:
    return list(prompts if limit is None else prompts[:limit])


Progress = Callable[[str], None]


# --- the router on a sped-up simulator ------------------------------------------------------

# The router's own clocks (seconds at --time-scale 1): telemetry poll, active health
# checks, and the goodput strategy's minimum dwell between switches.
ROUTER_TELEMETRY_S = 0.1
ROUTER_IDLE_TELEMETRY_S = 1.0
ROUTER_HEALTH_S = 2.0
ROUTER_DWELL_S = 1.0
# the online strategy's defaults (OnlineParams, TelemetrySettings), scaled the same way
ROUTER_ONLINE_DWELL_S = 2.0
ROUTER_SUSTAINED_S = 5.0
ROUTER_SUSTAINED_FALL_S = 30.0
ROUTER_HALF_LIFE_S = 300.0


def router_time_env(time_scale: float) -> dict[str, str]:
    """Settings that make the router's timers run on the simulator's clock.

    The simulator runs 1 / time_scale times faster than real time; the router's timers
    run in real time. Scaling them by `time_scale` keeps them the same number of engine
    steps apart as at time scale 1, so the router sees the world it would see on a GPU.
    The arrival window is NOT scaled: it is about how far apart in real time the
    requests of a burst reach the router (client and CPU speed), which the simulator's
    clock does not change.
    """
    return {"SPECROUTER_TELEMETRY__INTERVAL_S": repr(ROUTER_TELEMETRY_S * time_scale),
            "SPECROUTER_TELEMETRY__IDLE_INTERVAL_S": repr(ROUTER_IDLE_TELEMETRY_S * time_scale),
            "SPECROUTER_HEALTH__INTERVAL_S": repr(ROUTER_HEALTH_S * time_scale),
            "SPECROUTER_TELEMETRY__SUSTAINED_S": repr(ROUTER_SUSTAINED_S * time_scale),
            "SPECROUTER_TELEMETRY__SUSTAINED_FALL_S": repr(ROUTER_SUSTAINED_FALL_S * time_scale),
            "SPECROUTER_TELEMETRY__LEARN_HALF_LIFE_S": repr(ROUTER_HALF_LIFE_S * time_scale)}


def scaled_policy(policy: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """A policy with its time fields (goodput dwell and probe period) on the simulator's
    clock."""
    dwell = float(policy.get("goodput_min_dwell_s", ROUTER_DWELL_S))
    out = {**policy, "goodput_min_dwell_s": round(dwell * time_scale, 6)}
    online_dwell = float(policy.get("online_min_dwell_s", ROUTER_ONLINE_DWELL_S))
    out["online_min_dwell_s"] = round(online_dwell * time_scale, 6)
    for key in ("goodput_probe_s", "goodput_probe_memory_s"):
        if key in policy:
            out[key] = round(float(policy[key]) * time_scale, 6)
    return out


# Calibrations already run in this process, by (profile, control): the sweep's
# calibration of a profile is reused by a trace on the same profile and workload.
CALIBRATIONS: dict[tuple[str, str], dict[str, Any]] = {}


def cached_calibration(key: tuple[str, str] | None) -> dict[str, Any] | None:
    found = CALIBRATIONS.get(key) if key is not None else None
    return None if found is None else {**found, "reused": True}


def calibrate(eagle_url: str, baseline_url: str, levels: Sequence[int], duration_s: float,
              input_tokens: int, output_tokens: int, out_dir: str | None, tag: str,
              log: Callable[[str], None], cache_key: tuple[str, str] | None = None,
              time_scale: float | None = None) -> dict[str, Any]:
    """`specrouter calibrate --strategy threshold` against one simulated group, as a user
    would run it: returns its policy (`--write-policy`), crossover, accept length and fitted
    cost model (`--json`, `--write-cost-model`). The threshold band is what the sweep and
    trace routers are given; the model is what seeds the default (online) strategy of the
    open-loop scenario's calibrated router, as `calibrate` with its default strategy would
    write it. With `cache_key`, an earlier calibration of the same key is returned instead."""
    cached = cached_calibration(cache_key)
    if cached is not None:
        log(f"  calibrate {tag}: reusing the calibration of {cache_key}: {cached['policy']}")
        return cached
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    folder = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="calibrate-"))
    folder.mkdir(parents=True, exist_ok=True)
    policy_file = folder / f"calibrate-{tag}-policy.json"
    json_file = folder / f"calibrate-{tag}.json"
    model_file = folder / f"calibrate-{tag}-cost-model.json"
    argv = ["specrouter", "calibrate", "--eagle-url", eagle_url, "--baseline-url", baseline_url,
            "--concurrency", ",".join(map(str, levels)), "--duration", f"{duration_s:g}",
            "--input-tokens", str(input_tokens), "--output-tokens", str(output_tokens),
            "--strategy", "threshold", "--write-cost-model", str(model_file),
            "--write-policy", str(policy_file), "--json", str(json_file)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"specrouter calibrate failed ({done.returncode}): "
                           f"{done.stderr[-1500:]}")
    data = json.loads(json_file.read_text(encoding="utf-8"))
    policy = json.loads(policy_file.read_text(encoding="utf-8"))
    log(f"  calibrate {tag}: crossover {data.get('crossover')} accept "
        f"{data.get('accept_length')} -> {policy} ({time.perf_counter() - started:.0f} s)")
    command = " ".join(a if a not in (eagle_url, baseline_url) else
                       ("EAGLE_URL" if a == eagle_url else "BASELINE_URL") for a in argv)
    result = {"policy": policy, "crossover": data.get("crossover"),
              "accept_length": data.get("accept_length"), "levels": data.get("levels"),
              "cost_model": data.get("cost_model"),
              "command": command.replace(str(folder) + "/", ""), "time_scale": time_scale,
              "tag": tag}
    if cache_key is not None:
        CALIBRATIONS[cache_key] = result
    return result


def group_reports(router_url: str) -> list[dict[str, Any]]:
    """Each group's `GET /policy` report now: its load, choice, crossover and (online
    strategy) what the model learned; [] when the router does not answer."""
    import httpx

    try:
        groups = loopback.get(f"{router_url}/policy", timeout=5.0).json().get("groups", [])
    except (httpx.HTTPError, ValueError):
        return []
    keep = ("group", "load", "sustained_load", "choice", "reason", "crossover",
            "accept_length_used", "learned")
    return [{k: g.get(k) for k in keep if k in g} for g in groups if isinstance(g, dict)]


def decision_counts(router_url: str) -> dict[str, float]:
    """The router's decisions so far, by `pool/reason` (from /metrics), under
    `recalled` the EAGLE-3 streams recalled before their first byte and under
    `handed_over` those handed over after it (each also counts as two decisions: the
    EAGLE-3 one and its second)."""
    import httpx

    try:
        text = loopback.get(f"{router_url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        for series, key in (("specrouter_recalls_total{", "recalled"),
                            ("specrouter_handovers_total{", "handed_over")):
            if line.startswith(series):
                out[key] = out.get(key, 0.0) + float(line.rpartition(" ")[2])
        if not line.startswith("specrouter_decisions_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        fields = dict(part.split("=", 1) for part in labels[labels.index("{") + 1:-1].split(","))
        key = f"{fields.get('pool', '?').strip(chr(34))}/{fields.get('reason', '?').strip(chr(34))}"
        out[key] = out.get(key, 0.0) + float(value)
    return out
