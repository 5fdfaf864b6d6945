"""A backend's recent answers against the TPOT objective (routing/affinity/objective.py)."""

from __future__ import annotations

from specrouter.config import AffinitySettings
from specrouter.routing.affinity.objective import MIN_ANSWERS, RECENT_ANSWERS, TpotObjective
from specrouter.routing.affinity.tracker import tracker_of


def test_a_backend_meets_the_objective_while_nine_in_ten_recent_answers_do() -> None:
    o = TpotObjective(["e", "b"], slo_ms=10.0)
    for _ in range(MIN_ANSWERS - 1):
        o.observe("e", 5.0)
    assert "e" not in o.meeting()  # too few answers to say
    o.observe("e", 5.0)
    assert o.meeting() == frozenset({"e"})
    o.observe("e", 10.0)  # at the objective is within it
    assert "e" in o.meeting()
    for _ in range(RECENT_ANSWERS):
        o.observe("e", 5.0)
    o.observe("e", 11.0)
    assert "e" in o.meeting()  # 1 of 16 above: 94% within
    o.observe("e", 11.0)
    assert "e" not in o.meeting()  # 2 of 16: 88%
    assert o.within_shares() == {"e": 0.875}  # "b" has no answers: no reading
    report = o.report()
    assert report["e"] == {"answers": RECENT_ANSWERS, "within_share": 0.875, "meets": False}
    assert report["b"] == {"answers": 0, "within_share": 0.0, "meets": False}


def test_only_the_latest_answers_count() -> None:
    o = TpotObjective(["e"], slo_ms=10.0)
    for _ in range(RECENT_ANSWERS):
        o.observe("e", 50.0)  # a load that has passed
    for _ in range(RECENT_ANSWERS):
        o.observe("e", 5.0)
    assert "e" in o.meeting()
    o.observe("other", 1.0)  # an unknown backend is ignored
    assert o.meeting() == frozenset({"e"})


def test_a_session_lookup_carries_the_backends_meeting_the_objective() -> None:
    tracker = tracker_of(AffinitySettings(tpot_slo_ms=10.0), ["e", "b"])
    for _ in range(MIN_ANSWERS):
        tracker.observe_pace("e", 5.0)
        tracker.observe_pace("b", 50.0)
    lookup = tracker.lookup(None, "session-1")
    assert lookup is not None and lookup.meeting_slo == frozenset({"e"})
    assert tracker.tpot_within_shares() == {"e": 1.0, "b": 0.0}  # what /metrics shows
    shown = tracker.stats()["tpot_objective"]
    assert shown["slo_ms"] == 10.0 and shown["backends"]["b"]["meets"] is False
    # without an objective nothing is kept and nothing is shown
    plain = tracker_of(AffinitySettings(), ["e"])
    plain.observe_pace("e", 5.0)
    lookup = plain.lookup(None, "session-1")
    assert lookup is not None and lookup.meeting_slo is None
    assert plain.stats()["tpot_objective"] is None and plain.tpot_within_shares() == {}
