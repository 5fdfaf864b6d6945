"""The host's CPU shares recorded for each bench scenario (`loadtest.hostcpu`) and printed in
the report's header."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest import bench, hostcpu, report

BEFORE = "cpu  1000 10 200 5000 40 0 50 100 0 0\ncpu0 500 5 100 2500 20 0 25 50 0 0\n"
# 300 user, 0 nice, 100 system, 400 idle, 0 iowait, 0 irq, 0 softirq, 200 steal
AFTER = "cpu  1300 10 300 5400 40 0 50 300 0 0\ncpu0 650 5 150 2700 20 0 25 150 0 0\n"


def test_shares_split_the_time_between_two_readings() -> None:
    share = hostcpu.shares(hostcpu.CpuTimes.parse(BEFORE), hostcpu.CpuTimes.parse(AFTER))
    assert share == pytest.approx({"busy": 0.4, "idle": 0.4, "steal": 0.2})
    assert hostcpu.describe(share) == "busy 40%, idle 40%, stolen by the hypervisor 20%"


def test_no_shares_without_two_readings_or_time_between_them() -> None:
    before = hostcpu.CpuTimes.parse(BEFORE)
    assert hostcpu.shares(None, before) is None
    assert hostcpu.shares(before, None) is None
    assert hostcpu.shares(before, before) is None
    with pytest.raises(ValueError, match="no aggregate"):
        hostcpu.CpuTimes.parse("cpu0 1 2 3 4\n")


def test_a_scenario_run_by_the_bench_carries_the_hosts_shares() -> None:
    assert hostcpu.CpuTimes.read() is not None  # the suite runs on Linux

    def job() -> dict[str, Any]:
        # the bench read the host's times before this; they differ from that reading
        # once they differ from this later one (the counters only grow)
        start = hostcpu.CpuTimes.read()
        while hostcpu.CpuTimes.read() == start:  # until the host's clock ticks
            pass
        return {"scenario": "probe"}

    result = bench._guarded("probe", job)
    assert result is not None
    share = result[hostcpu.RESULT_KEY]
    assert sum(share.values()) == pytest.approx(1.0, abs=0.011)
    assert 0.0 <= share["steal"] <= 1.0


def test_the_report_header_names_each_scenarios_host_shares() -> None:
    share = {"busy": 0.59, "idle": 0.31, "steal": 0.1}
    results: dict[str, Any] = {"probe": {"scenario": "probe", hostcpu.RESULT_KEY: share}}
    header = report.render(results, {}, ["pytest"], "", "now", 1.0).split("\n\n")[2]
    lines = header.splitlines()
    machine = next(i for i, line in enumerate(lines) if line.startswith("- Machine:"))
    assert lines[machine + 1] == (
        "- Host CPU while each scenario ran (a share stolen by the hypervisor, or idle under a "
        "load meant to fill the cores, makes that scenario's figures slower and noisier than "
        "the code): probe busy 59%, idle 31%, stolen by the hypervisor 10%")
    assert report.host_cpu_lines({"probe": {"scenario": "probe"}}) == []
