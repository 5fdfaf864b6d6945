"""The engines' reported cached tokens against the index's prediction
(specrouter.routing.affinity.retention, and the tracker's use of it)."""

from __future__ import annotations

import pytest

from specrouter.config import AffinitySettings
from specrouter.routing.affinity.keys import PrefixKeys
from specrouter.routing.affinity.retention import MIN_SAMPLES, Retention
from specrouter.routing.affinity.tracker import tracker_of


def keys(*k: int, prompt: float | None = None) -> PrefixKeys:
    return PrefixKeys(k, 512.0, prompt if prompt is not None else 512.0 * len(k))


def test_retention_is_the_reported_share_over_the_predicted_one() -> None:
    r = Retention(["e", "b"], max_sessions=10, weight=0.5, applied=True)
    assert r.share("e") == 1.0
    # predicted 80% of 10,000 tokens, 20% reported: a quarter of the prediction held
    r.observe("e", None, 0.8, 10_000, 2_000, block_tokens=512)
    assert r.share("e") == pytest.approx(1.0 - 0.5 * 0.75)
    r.observe("e", None, 0.8, 10_000, 2_000, block_tokens=512)
    assert r.share("e") == pytest.approx(0.625 - 0.5 * 0.375)
    # more cached than predicted counts as all of it held
    r.observe("b", None, 0.2, 10_000, 9_000, block_tokens=512)
    assert r.share("b") == 1.0
    assert r.stats() == {"e": {"share": 0.4375, "samples": 2, "applied": True},
                         "b": {"share": 1.0, "samples": 1, "applied": True}}


def test_a_prediction_under_one_block_is_not_counted() -> None:
    r = Retention(["e"], max_sessions=10, applied=True)
    r.observe("e", "s", 0.04, 10_000, 0, block_tokens=512)  # 400 tokens predicted
    r.observe("e", "s", 0.0, 10_000, 0, block_tokens=512)
    r.observe("x", "s", 0.9, 10_000, 0, block_tokens=512)  # not a backend it knows
    assert r.stats() == {"e": {"share": 1.0, "samples": 0, "applied": True}}
    assert not r.lost("s", "e")


def test_a_session_loses_its_credit_when_its_turn_comes_back_uncached() -> None:
    r = Retention(["e", "b"], max_sessions=2, lost_below=0.5, applied=True)
    r.observe("e", "s", 0.9, 30_000, 3_000, block_tokens=512)
    assert r.lost("s", "e") and not r.lost("s", "b")
    r.observe("e", "s", 0.9, 31_000, 29_000, block_tokens=512)  # cached again
    assert not r.lost("s", "e")
    for name in ("s1", "s2", "s3"):  # at most max_sessions remembered, oldest first out
        r.observe("e", name, 0.9, 30_000, 0, block_tokens=512)
    assert not r.lost("s1", "e") and r.lost("s2", "e") and r.lost("s3", "e")


def test_the_tracker_scales_its_prediction_and_drops_a_lost_session() -> None:
    t = tracker_of(AffinitySettings(block_bytes=2048, retention_weight=1.0,
                                    retention_applied=True), ["e", "b"])
    first = keys(1, 2, 3, 4)
    t.record(first, "s", "e", t.lookup(first, "s"))
    t.record(keys(1, 2), None, "b", t.lookup(keys(1, 2), None))
    look = t.lookup(keys(1, 2, 3, 4, 5), None)
    assert look is not None and dict(look.held) == {"e": 2048.0, "b": 1024.0}
    # e reported half of what the index predicted for another request
    t.observe_cached("e", None, 1.0, 4_000, 2_000)
    look = t.lookup(keys(1, 2, 3, 4, 5), None)
    assert look is not None and dict(look.held) == {"e": 1024.0, "b": 1024.0}
    assert dict(look.predicted or {}) == {"e": 2048.0, "b": 1024.0}
    # the session's last turn on e came back uncached: no credit there at all
    t.observe_cached("e", "s", 0.8, 2_560, 0)
    look = t.lookup(keys(1, 2, 3, 4, 5), "s")
    assert look is not None and look.held["e"] == 0.0 and look.held["b"] == 1024.0
    assert look.session_backend == "e"
    assert t.stats()["retention"] == {"e": {"share": 0.0, "samples": 2, "applied": True},
                                      "b": {"share": 1.0, "samples": 0, "applied": True}}


def test_measured_only_the_retention_leaves_the_prediction_whole() -> None:
    t = tracker_of(AffinitySettings(block_bytes=2048, retention_weight=1.0), ["e", "b"])
    first = keys(1, 2, 3, 4)
    t.record(first, "s", "e", t.lookup(first, "s"))
    t.observe_cached("e", "s", 0.8, 2_560, 0)
    look = t.lookup(keys(1, 2, 3, 4, 5), "s")
    assert look is not None and dict(look.held) == {"e": 2048.0}
    assert t.stats()["retention"]["e"] == {"share": 0.0, "samples": 1, "applied": False}


def test_a_retention_counts_as_measured_from_its_fifth_report_applied_or_not() -> None:
    t = tracker_of(AffinitySettings(block_bytes=2048, retention_weight=0.2), ["e", "b"])
    first = keys(1, 2, 3, 4)
    t.record(first, "s", "e", t.lookup(first, "s"))
    for _ in range(MIN_SAMPLES):
        look = t.lookup(keys(1, 2, 3, 4, 5), "s")
        assert look is not None and dict(look.retention or {}) == {}
        t.observe_cached("e", "s", 0.8, 2_560, 0)  # the engine evicted it
    look = t.lookup(keys(1, 2, 3, 4, 5), "s")
    assert look is not None and look.retention is not None
    assert look.retention["e"] == pytest.approx(0.8 ** MIN_SAMPLES)
    assert "b" not in look.retention  # no report from b
    assert dict(look.held) == {"e": 2048.0}  # measured only: the prediction stays whole
