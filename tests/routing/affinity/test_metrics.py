"""Affinity hits and misses in /metrics."""

from __future__ import annotations

from specrouter.control.metrics import RouterMetrics


def test_affinity_hits_and_misses_are_counted_in_metrics() -> None:
    metrics = RouterMetrics()
    metrics.observe_affinity(True)
    metrics.observe_affinity(True)
    metrics.observe_affinity(False)
    text = metrics.render().decode()
    assert 'specrouter_affinity_total{result="hit"} 2.0' in text
    assert 'specrouter_affinity_total{result="miss"} 1.0' in text
