"""Affinity hits and misses in /metrics."""

from __future__ import annotations

from specrouter.control.metrics import RouterMetrics
from specrouter.routing.report import LiveMetrics


def test_affinity_hits_and_misses_are_counted_in_metrics() -> None:
    metrics = RouterMetrics()
    metrics.observe_affinity(True)
    metrics.observe_affinity(True)
    metrics.observe_affinity(False)
    text = metrics.render().decode()
    assert 'specrouter_affinity_total{result="hit"} 2.0' in text
    assert 'specrouter_affinity_total{result="miss"} 1.0' in text


def test_each_backends_cache_retention_is_a_gauge() -> None:
    metrics = RouterMetrics()
    metrics.attach(lambda: LiveMetrics(cache_retention={"e0": 0.25, "b0": 1.0}))
    text = metrics.render().decode()
    assert 'specrouter_affinity_retention{backend="e0"} 0.25' in text
    assert 'specrouter_affinity_retention{backend="b0"} 1.0' in text


def test_each_backends_share_of_answers_within_the_tpot_objective_is_a_gauge() -> None:
    metrics = RouterMetrics()
    metrics.attach(lambda: LiveMetrics(tpot_within_share={"e0": 0.875}))
    text = metrics.render().decode()
    assert 'specrouter_affinity_tpot_within_share{backend="e0"} 0.875' in text
