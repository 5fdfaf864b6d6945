"""The soak script's short version: steady streaming load through a real router, then
bounded memory growth, descriptors back to the pre-load count, zero leaked in-flight."""

from __future__ import annotations

from loadtest.soak import SoakConfig, run_soak, to_markdown


def test_short_soak_memory_fds_and_counts_stay_flat() -> None:
    # fd_slack: the idle upstream keep-alive pool (at most one connection per concurrent
    # request) may still be open; the 10-minute soak waits for it to close (docs).
    cfg = SoakConfig(duration_s=10.0, concurrency=32, interval_s=1.0, warmup_s=3.0,
                     time_scale=0.05, max_tokens=48, max_growth_mib=16.0, fd_slack=32 + 16,
                     settle_s=10.0)
    report = run_soak(cfg)
    summary = to_markdown(report, "run_soak(short)")
    assert report.ok > 100, summary
    assert report.failed == 0, summary
    assert report.inflight_after == 0, summary
    assert report.fds_after <= report.fds_before + cfg.fd_slack, summary
    assert report.growth_mib <= cfg.max_growth_mib, summary
    # The sampler saw the load: requests in flight while it ran.
    assert max(s.inflight for s in report.samples) > 0, summary
    assert report.passed, summary
