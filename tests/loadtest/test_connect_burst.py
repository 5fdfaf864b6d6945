"""The connect-burst scenario end to end (its smoke version): every path serves the whole
burst, and the report has a row per path."""

from __future__ import annotations

from loadtest import report
from loadtest.scenarios import connect_burst
from loadtest.scenarios.overhead import DIRECT, SPECROUTER


def test_a_quick_burst_is_served_on_every_path_and_reported() -> None:
    s = connect_burst.quick(connect_burst.BurstSettings())
    result = connect_burst.run(s)
    paths = result["paths"]
    assert {DIRECT, SPECROUTER} <= set(paths)
    for name, figures in paths.items():
        assert figures["burst_requests"] == s.burst, name
        assert figures["burst_failed"] == 0, name
        assert 0 < figures["burst_p50_ms"] <= figures["burst_p99_ms"] <= figures["burst_max_ms"]
        assert figures["busy_req_s"] > 0, name
    text = report.render({"connect-burst": result}, {}, ["pytest"], "", "now", 1.0)
    rows = [line for line in text.splitlines() if line.startswith(f"| {SPECROUTER} |")]
    assert len(rows) == 1 and f"0 of {s.burst}" in rows[0]
