"""The online model's batch caps (with `kv_room` on): an engine that queues below its max
running requests with its KV pool nearly full bounds the batch at its running count, and
the other pool at its own KV pool's share; the caps recover toward the engines' max
(routing/online.py `note_load`, fed by routing/learning.py)."""

from __future__ import annotations

import pytest

from specrouter.observe.loadview import EngineSample, LoadView
from specrouter.routing.learning import CostLearning
from specrouter.routing.online import ROOM_FULL_SHARE, OnlineCostModel

EAGLE_KV, BASE_KV = 400_000, 500_000  # h200-llama3-8b's pools


def model(kv_room: bool = True) -> OnlineCostModel:
    m = OnlineCostModel(room_half_life_s=30.0, kv_room=kv_room)
    m.note_max_batch("eagle", 48)
    m.note_max_batch("baseline", 256)
    for pool, kv in (("eagle", EAGLE_KV), ("baseline", BASE_KV)):
        m.note_load(pool, 0, 0, 0.0, kv, 0)  # an idle engine's reading: its pool's size
    return m


def test_a_kv_bound_queue_lowers_the_cap_to_the_running_count() -> None:
    m = model()
    assert m.model(1.0).eagle_max_batch == 48
    m.note_load("eagle", 12, 3, 10.0, EAGLE_KV, int(0.95 * EAGLE_KV))
    got = m.model(10.0)
    assert (got.eagle_max_batch, got.engine_max_batch["eagle"]) == (12, 48)
    # the baseline's pool holds 500,000 / (400,000 / 12) = 15 such requests
    assert got.baseline_max_batch == 15
    # the prediction counts what is beyond the cap as queued: the batch stays at 12
    pred = got.predict("eagle", 20, 2.5)
    assert pred.batch == 12 and pred.tpot_ms == pytest.approx(1000 * 20 / pred.throughput_tok_s)
    assert got.describe(2.5)["batch_cap"]["eagle"] == {"effective": 12, "engine": 48,
                                                        "kv_room": 12}


def test_with_kv_room_off_the_model_keeps_the_engines_max_and_shows_the_room() -> None:
    m = model(kv_room=False)
    m.note_load("eagle", 12, 3, 10.0, EAGLE_KV, int(0.95 * EAGLE_KV))
    got = m.model(10.0)
    assert (got.eagle_max_batch, got.baseline_max_batch) == (48, 256)
    assert got.describe(2.5)["batch_cap"]["baseline"] == {"effective": 256, "engine": 256,
                                                           "kv_room": 15}


def test_a_queue_behind_a_prefill_leaves_the_cap() -> None:
    m = model()
    # requests wait for a chunked prefill while the pool is a third full: not the KV room
    m.note_load("eagle", 3, 2, 10.0, EAGLE_KV, int(0.3 * EAGLE_KV))
    m.note_load("eagle", 48, 5, 11.0, EAGLE_KV, EAGLE_KV)  # at the max: the max binds
    just_below = int(ROOM_FULL_SHARE * EAGLE_KV) - 1
    m.note_load("eagle", 10, 1, 12.0, EAGLE_KV, just_below)
    m.note_load("eagle", 10, 1, 12.0, None, None)  # a source without the KV fields
    assert m.model(12.0).eagle_max_batch == 48 and m.batch_cap("baseline", 12.0) == 256


def test_the_cap_recovers_toward_the_engines_max_with_the_half_life() -> None:
    m = model()
    m.note_load("eagle", 12, 3, 10.0, EAGLE_KV, EAGLE_KV)
    m.note_load("eagle", 8, 0, 10.0, EAGLE_KV, EAGLE_KV // 2)  # no queue, fewer running
    assert m.batch_cap("eagle", 10.0) == 12
    assert m.batch_cap("eagle", 40.0) == 30  # one half-life: halfway from 12 to 48
    assert m.batch_cap("eagle", 400.0) == 48
    # a new KV-bound queue sets it again, at the count running then
    m.note_load("eagle", 14, 1, 400.0, EAGLE_KV, EAGLE_KV)
    assert m.batch_cap("eagle", 400.0) == 14


def test_a_running_count_above_the_cap_raises_both_pools_caps() -> None:
    m = model()
    m.note_load("baseline", 15, 4, 10.0, BASE_KV, BASE_KV)  # 33,333 tokens a request
    assert (m.batch_cap("eagle", 10.0), m.batch_cap("baseline", 10.0)) == (12, 15)
    m.note_load("eagle", 16, 0, 11.0, EAGLE_KV, EAGLE_KV // 2)  # shorter contexts now
    assert (m.batch_cap("eagle", 11.0), m.batch_cap("baseline", 11.0)) == (16, 20)


def test_telemetry_samples_feed_the_caps() -> None:
    view = LoadView()
    view.add_backend("g0-e", "g0", "eagle")
    view.add_backend("g0-b", "g0", "baseline")
    learning = CostLearning(view, kv_room=True)
    for name, kv in (("g0-e", EAGLE_KV), ("g0-b", BASE_KV)):
        learning.sample(name, EngineSample(0, 0, 1.0, max_running=48 if name == "g0-e"
                                           else 256, kv_tokens=kv, kv_used=0))
    # no gen_throughput (no decode window): the load reading still counts
    learning.sample("g0-e", EngineSample(10, 4, 2.0, max_running=48, kv_tokens=EAGLE_KV,
                                         kv_used=int(0.9 * EAGLE_KV)))
    got = learning.model("g0", 2.0)
    assert (got.eagle_max_batch, got.baseline_max_batch) == (10, 12)
