"""The live view of a group in GET /policy."""

from __future__ import annotations

import pathlib

import pytest

from specrouter.routing.costmodel import DraftConfig, GroupCostModel, model_from_step_table
from specrouter.routing.decision import GroupState
from specrouter.routing.policy import Policy
from specrouter.routing.report import group_report
from specrouter.steptable import parse_step_table
from tests.fixtures.procs import CALIBRATION_DIR
from tests.routing.helpers import group


def llama() -> GroupCostModel:
    """The measured H200 llama3-8b step costs, chain draft 3/1/4, no EAGLE-3 cap."""
    text = (pathlib.Path(CALIBRATION_DIR) / "llama3-8b-ctx2048.jsonl").read_text()
    return model_from_step_table(parse_step_table(text), DraftConfig(3, 1, 4),
                                 eagle_max_batch=None)


GOODPUT = Policy(strategy="goodput", load_signal="inflight", accept_smoothing=1.0)


def test_group_report_for_policy_endpoint() -> None:
    m = llama()
    r = group_report(GOODPUT, group(eagle=70, accept=2.5, accept_at=0.0), GroupState(), 5.0, m)
    assert (r["choice"], r["reason"], r["load"]) == ("baseline", "goodput_baseline", 70.0)
    assert r["crossover"] == pytest.approx(m.crossover(2.5))
    assert r["predictions"]["baseline"]["throughput_tok_s"] > r["predictions"]["eagle"][
        "throughput_tok_s"]
    dead = group_report(GOODPUT, group(eagle_ok=False, base_ok=False), GroupState(), 5.0)
    assert (dead["choice"], dead["reason"]) == (None, "no_healthy_server")
