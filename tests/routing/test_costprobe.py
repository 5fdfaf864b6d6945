"""Cost probes, the pure side (routing/costprobe.py): the body sent, the answer read, the
step read from a short and a long round; and what a probe reading does to the online
model (routing/online.py)."""

from __future__ import annotations

import json

import pytest

from specrouter.routing.costmodel import PolyCurve
from specrouter.routing.costprobe import (
    PROBE_WEIGHT,
    SUFFIX_TOKENS,
    ProbeAnswer,
    context_due,
    cost_probe_body,
    due,
    parse_answer,
    probe_context,
    probe_prefix,
    step_reading,
)
from specrouter.routing.online import OnlineCostModel
from tests.routing.test_online import H200, SEED, feed


def answer(tokens: int, e2e_s: float, **spec: float) -> bytes:
    return json.dumps({"text": "x", "meta_info": {"completion_tokens": tokens,
                                                  "e2e_latency": e2e_s, **spec}}).encode()


def test_a_probes_generations_share_its_prefix_and_differ_after_it() -> None:
    prefix = probe_prefix(32)
    assert prefix != probe_prefix(32)  # no probe finds another's prefix cached
    warm = json.loads(cost_probe_body(prefix, 1, "w", suffix=False))
    a, b = (json.loads(cost_probe_body(prefix, 64, rid)) for rid in ("r1", "r2"))
    assert warm["input_ids"] == prefix
    assert a["input_ids"][:32] == b["input_ids"][:32] == prefix
    assert len(a["input_ids"]) == 32 + SUFFIX_TOKENS and a["input_ids"] != b["input_ids"]
    assert a["rid"] == "r1"
    assert a["sampling_params"] == {"max_new_tokens": 64, "ignore_eos": True,
                                    "temperature": 0.0}


def test_a_probe_decodes_at_the_traffics_context_within_its_bounds() -> None:
    assert probe_context(None, 512, 32768, None) == 512  # no traffic yet: the floor
    assert probe_context(30000.4, 512, 32768, None) == 30000
    assert probe_context(100.0, 512, 32768, None) == 512
    assert probe_context(90000.0, 512, 32768, None) == 32768
    assert probe_context(30000.0, 512, 32768, 40000) == 20000  # half the KV pool at most


def test_a_pool_read_only_by_probes_is_due_when_the_context_moved_twofold() -> None:
    assert context_due(512.0, 30000.0, 0)
    assert context_due(30000.0, 512.0, 0)
    assert not context_due(512.0, 1000.0, 0)  # within twice
    assert not context_due(512.0, 30000.0, 3)  # its telemetry read it at the traffic's
    assert not context_due(None, 30000.0, 0) and not context_due(512.0, None, 0)


def test_a_probe_at_another_context_replaces_the_pools_readings() -> None:
    m = OnlineCostModel(half_life_s=300.0)
    m.observe("baseline", 1.0, 20.9, 0.0, probe=True, context=512.0)
    m.observe("baseline", 1.0, 23.0, 1.0)  # a telemetry window
    assert m.learned(1.0)["baseline"].read_since_probe == 1
    m.observe("baseline", 1.0, 23.0, 2.0, probe=True, context=30000.0)
    learned = m.learned(2.0)["baseline"]
    assert learned.readings == 1 and learned.probe_context == 30000.0
    assert learned.read_since_probe == 0
    assert learned.curve.ms(1.0) == pytest.approx(23.0, rel=0.01)
    # a probe within twice the context adds to the readings; a shared reading of an
    # older replica (context 0) neither replaces them nor moves the probe's context
    m.observe("baseline", 1.0, 23.2, 3.0, probe=True, context=20000.0)
    m.observe("baseline", 1.0, 23.1, 4.0, context=0.0)
    learned = m.learned(4.0)["baseline"]
    assert learned.readings == 3 and learned.probe_context == 20000.0


def test_steps_are_tokens_on_the_baseline_and_verify_steps_on_eagle() -> None:
    assert parse_answer(answer(64, 0.5), "baseline", 9.0) == ProbeAnswer(500.0, 64.0)
    assert parse_answer(answer(64, 0.5, spec_verify_ct=25), "eagle", 9.0) == ProbeAnswer(
        500.0, 25.0)
    assert parse_answer(answer(60, 0.5, spec_accept_length=2.5), "eagle", 9.0) == ProbeAnswer(
        500.0, 24.0)
    # no e2e_latency: the router's own wall time; no step count: nothing to read
    raw = json.dumps({"meta_info": {"completion_tokens": 8}}).encode()
    assert parse_answer(raw, "baseline", 9.0) == ProbeAnswer(9.0, 8.0)
    assert parse_answer(raw, "eagle", 9.0) is None
    assert parse_answer(b"not json", "baseline", 9.0) is None
    assert parse_answer(b"[1]", "baseline", 9.0) is None


def test_the_step_cancels_prefill_and_overhead() -> None:
    # prefill 40 ms and 3 ms of HTTP either way, then 7 ms a step
    short = [ProbeAnswer(43.0 + 7.0, 1.0)]
    long = [ProbeAnswer(43.0 + 7.0 * 64, 64.0), ProbeAnswer(43.0 + 7.0 * 64 + 2.0, 64.0)]
    assert step_reading(short, long) == pytest.approx(7.0 + 1.0 / 63)
    assert step_reading([], long) is None
    assert step_reading(short, [ProbeAnswer(49.0, 1.0)]) is None  # no step between them


def test_a_pool_is_due_until_read_and_again_once_its_readings_decayed() -> None:
    m = OnlineCostModel(half_life_s=10.0)
    assert due(m.learned(0.0)["baseline"].weight)
    m.observe("baseline", 1.0, 20.0, 0.0, PROBE_WEIGHT, probe=True)
    assert not due(m.learned(5.0)["baseline"].weight)
    assert due(m.learned(10.5)["baseline"].weight)


@pytest.mark.parametrize(("truth", "accept", "lo", "hi"), [(SEED, 2.0, 1.0, 4.0),
                                                          (H200, 2.5, 30.0, 60.0)])
def test_one_baseline_probe_puts_the_crossover_near_the_truth(
        truth: dict[str, PolyCurve], accept: float, lo: float, hi: float) -> None:
    """EAGLE-3 read by telemetry at batches 1-11; the baseline only by one probe at batch
    1: its intercept is measured and its slope is EAGLE-3's through the transfer. Without
    the probe the transfer's fixed intercept ratio (1.7) puts H200's crossover at ~18."""
    unprobed = OnlineCostModel(prior_weight=4.0)
    t = feed(unprobed, truth, "eagle", range(1, 12), 0.0)
    probed = OnlineCostModel(prior_weight=4.0)
    probed.observe("baseline", 1.0, truth["baseline"].ms(1.0), 0.0, probe=True)
    feed(probed, truth, "eagle", range(1, 12), 0.0)
    crossover = probed.model(t).crossover(accept)
    assert crossover is not None and lo <= crossover <= hi
    assert probed.learned(t)["baseline"].probes == 1
    if truth is H200:
        before = unprobed.model(t).crossover(accept)
        assert before is not None and before < lo


def test_a_one_token_eagle_answer_ran_no_verify_step() -> None:
    assert parse_answer(answer(1, 0.01), "eagle", 9.0) == ProbeAnswer(10.0, 0.0)
