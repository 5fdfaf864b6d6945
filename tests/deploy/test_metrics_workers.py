"""`specrouter serve --workers 2`: /metrics is one view over both worker processes, whichever
worker a scrape reaches; the merge rules (sums, most recent gauge, dead workers) are checked
in one process with two simulated workers writing to one directory."""

from __future__ import annotations

import glob
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client import Gauge, values
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from specrouter.control.metrics import MULTIPROC_ENV, RouterMetrics
from specrouter.routing.report import BackendLive, LiveMetrics
from tests.fixtures.procs import wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory, RouterProc

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REQUESTS = 20


def scrape(proc: RouterProc) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One scrape on a fresh connection (the kernel hands it to either worker)."""
    return _samples(loopback.get(f"{proc.url}/metrics", timeout=5.0).text)


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def requests_total(samples: dict[str, list[tuple[dict[str, str], float]]]) -> float:
    return sum(v for _, v in samples.get("specrouter_requests_total", []))


def worker_pids(directory: Path) -> set[int]:
    return {int(m.group(1)) for f in glob.glob(str(directory / "*" / "*.db"))
            if (m := re.search(r"_(\d+)\.db$", f))}


def test_two_workers_answer_metrics_as_one(
    redis_server: RedisServer, sim_group: Any, router: RouterFactory, tmp_path: Path
) -> None:
    group = sim_group(time_scale=0.02)
    backends = [{"name": f"gpu0-{pool}", "url": group.url(pool), "pool": pool, "group": "gpu0"}
                for pool in ("eagle", "baseline")]
    proc = router(backends, extra_args=("--workers", "2"),
                  env={"SPECROUTER_REDIS_URL": redis_server.url(),
                       "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    # Each worker publishes its series within a second of starting.
    wait_until(lambda: len(worker_pids(tmp_path)) == 2, 20.0, "both workers' metric files")

    seen: list[float] = []
    for _ in range(REQUESTS):
        with openai.OpenAI(base_url=proc.v1, api_key="none", max_retries=0) as client:
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content
        seen.append(requests_total(scrape(proc)))
    seen += [requests_total(scrape(proc)) for _ in range(8)]
    assert seen == sorted(seen), f"the counter went backwards: {seen}"
    assert seen[-8:] == [REQUESTS] * 8
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(worker_pids(tmp_path)) == 2

    proc.process.stop()
    assert not run_dir.exists()  # the directory belongs to this start only


# -- the merge rules, with two workers simulated in this process ----------------------------

def live(inflight: int, healthy: bool, accept: float | None, stale_reads: int) -> LiveMetrics:
    backend = BackendLive(name="gpu0-eagle", pool="eagle", group="gpu0", healthy=healthy,
                          breaker="closed", inflight=inflight, engine_load=None,
                          telemetry_age_s=None, stale_reads=stale_reads, accept_length=accept)
    return LiveMetrics(backends=(backend,), group_loads={"gpu0": float(inflight)},
                       group_pools={"gpu0": "eagle"}, policy_version=3)


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def worker(monkeypatch: pytest.MonkeyPatch, pid: int, source: Callable[[], LiveMetrics]
           ) -> RouterMetrics:
    """A RouterMetrics as worker `pid` builds it: prometheus_client's mmap-backed values."""
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: pid))
    metrics = RouterMetrics()
    assert metrics.multiprocess
    metrics.attach(source)
    return metrics


def test_merge_sums_counts_takes_the_latest_gauge_and_forgets_dead_workers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    gone = dead_pid()
    state_a = live(inflight=2, healthy=True, accept=3.1, stale_reads=5)
    a = worker(monkeypatch, os.getpid(), lambda: state_a)
    for _ in range(3):
        a.observe_request("eagle", "gpu0-eagle", 200, 0.01, 0.1)
    b = worker(monkeypatch, gone, lambda: live(inflight=3, healthy=False, accept=2.0,
                                               stale_reads=7))
    b.observe_request("eagle", "gpu0-eagle", 200, 0.02, 0.2)
    b.render()  # b answered a scrape before it died

    samples = _samples(a.render().decode())  # worker a answers; b is dead by now
    assert requests_total(samples) == 4  # b's count outlives b
    assert samples["specrouter_e2e_request_latency_seconds_count"] == [({"pool": "eagle"}, 4)]
    assert samples["specrouter_telemetry_stale_reads_total"] == [({"backend": "gpu0-eagle"}, 12)]
    # b's live gauges left with b: a's values alone, one series per label set
    assert samples["specrouter_inflight_requests"] == [
        ({"backend": "gpu0-eagle", "pool": "eagle", "group": "gpu0"}, 2)]
    assert samples["specrouter_backend_healthy"] == [({"backend": "gpu0-eagle"}, 1)]
    assert samples["specrouter_accept_length"] == [({"backend": "gpu0-eagle"}, 3.1)]
    assert not glob.glob(str(tmp_path / f"gauge_live*_{gone}.db"))

    state_a = live(inflight=0, healthy=True, accept=None, stale_reads=5)  # accept unknown now
    samples = _samples(a.render().decode())
    assert "specrouter_accept_length" not in samples  # dropped, not frozen at 3.1
    assert samples["specrouter_inflight_requests"][0][1] == 0


def test_live_workers_inflight_adds_up_and_gauges_take_the_latest(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    a = worker(monkeypatch, os.getpid(), lambda: live(2, True, 3.1, 0))
    b = worker(monkeypatch, os.getppid(), lambda: live(3, True, 2.5, 0))  # alive
    a.render()
    merged = _samples(b.render().decode())  # b answers last: its gauges are the latest
    assert merged["specrouter_inflight_requests"][0][1] == 5
    assert merged["specrouter_accept_length"] == [({"backend": "gpu0-eagle"}, 2.5)]


def test_one_process_keeps_its_registry() -> None:
    metrics = RouterMetrics()
    assert not metrics.multiprocess
    metrics.observe_decision("eagle", "low_load", "gpu0")
    assert b"specrouter_decisions_total" in metrics.render()


def test_every_gauge_declared_by_router_metrics_names_its_multiprocess_mode() -> None:
    gauges = [m for m in vars(RouterMetrics()).values() if isinstance(m, Gauge)]
    for gauge in gauges:  # "all" would export one series per worker pid
        assert gauge._multiprocess_mode != "all", gauge._name
