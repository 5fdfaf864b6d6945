"""The online cost model: readings in, a group cost model out (routing/online.py), and the
feed that turns telemetry windows into readings (routing/learning.py)."""

from __future__ import annotations

import math

import pytest

from specrouter.observe.loadview import EngineSample, InflightHistory, LoadView
from specrouter.routing.costmodel import GroupCostModel, PolyCurve
from specrouter.routing.costsource import profile_model
from specrouter.routing.learning import CostLearning, SustainedLoad, decode_batch
from specrouter.routing.online import OnlineCostModel, step_ms

# seed-coding's step lines at ctx 1024 (as lines: crossover 2.7 at accept 2.0) and
# H200 Llama-3.1-8B's (crossover ~44 at accept 2.5), as lines
SEED = {"eagle": PolyCurve(33.0, 4.33), "baseline": PolyCurve(20.0, 0.87)}
H200 = {"eagle": PolyCurve(6.5, 0.33), "baseline": PolyCurve(5.1, 0.066)}


def feed(m: OnlineCostModel, truth: dict[str, PolyCurve], pool: str, batches: range,
         t0: float, n: int = 40) -> float:
    t = t0
    for i in range(n):
        t += 1.0
        b = batches[i % len(batches)]
        m.observe(pool, b, truth[pool].ms(b), t)  # type: ignore[arg-type]
    return t


def test_step_ms_inverts_throughput() -> None:
    # 8 requests, 2.5 tokens each per step, 1000 tok/s: 20 ms a step
    assert step_ms(8, 2.5, 1000.0) == pytest.approx(20.0)
    assert step_ms(8, 1.0, 0.0) is None and step_ms(0, 1.0, 10.0) is None


@pytest.mark.parametrize(("truth", "accept", "lo", "hi"), [(SEED, 2.0, 1.0, 4.0),
                                                          (H200, 2.5, 30.0, 60.0)])
def test_readings_of_both_pools_find_the_crossover(truth: dict[str, PolyCurve], accept: float,
                                                   lo: float, hi: float) -> None:
    m = OnlineCostModel(prior_weight=4.0)
    t = feed(m, truth, "eagle", range(1, 12), 0.0)
    t = feed(m, truth, "baseline", range(2, 40), t)
    crossover = m.model(t).crossover(accept)
    assert crossover is not None and lo <= crossover <= hi
    pools = m.learned(t)
    assert pools["eagle"].readings == 40 and pools["eagle"].prior_share < 0.15


def test_a_pool_without_readings_follows_the_other_through_the_transfer() -> None:
    m = OnlineCostModel()
    t = feed(m, SEED, "eagle", range(1, 4), 0.0)
    model = m.model(t)
    # the baseline has no reading: its curve is EAGLE-3's, scaled by the transfer ratios
    assert model.baseline.ms(1) < model.eagle.ms(1) < 2.5 * model.baseline.ms(1)
    assert m.learned(t)["baseline"].prior_share == 1.0


def test_readings_are_forgotten_with_the_half_life() -> None:
    m = OnlineCostModel(half_life_s=10.0)
    feed(m, SEED, "baseline", range(1, 20), 0.0, n=20)
    assert m.learned(20.0)["baseline"].weight == pytest.approx(
        sum(0.5 ** (k / 10.0) for k in range(20)), rel=1e-6)
    # after a drift the new level wins within a few half-lives
    slower = {"baseline": PolyCurve(40.0, 1.74)}
    t = feed(m, slower, "baseline", range(1, 20), 100.0, n=60)
    assert m.model(t).baseline.ms(8) == pytest.approx(slower["baseline"].ms(8), rel=0.05)


def test_a_seed_keeps_its_shape_and_learns_its_level() -> None:
    seed = GroupCostModel(SEED["baseline"], SEED["eagle"], 2.0, 256, 48)
    m = OnlineCostModel(seed, seed_weight=16.0)
    assert m.model(0.0).eagle.ms(8) == pytest.approx(SEED["eagle"].ms(8))
    doubled = {"eagle": PolyCurve(66.0, 8.66)}
    t = feed(m, doubled, "eagle", range(1, 3), 0.0, n=200)
    assert m.model(t).eagle.ms(30) == pytest.approx(doubled["eagle"].ms(30), rel=0.1)
    assert m.model(t).eagle_max_batch == 48


def test_a_seed_in_other_units_keeps_its_ratio_of_the_pools() -> None:
    """A seed timed on another clock (10x): readings of one pool move the other pool's
    level with it, so the pools' ratio stays the seed's, also once those readings have
    decayed and only the other pool's remain."""
    seed = GroupCostModel(SEED["baseline"], SEED["eagle"], 2.0, 256, 48)
    m = OnlineCostModel(seed, half_life_s=10.0)

    def ratio(t: float) -> float:
        model = m.model(t)
        return model.eagle.ms(8) / model.baseline.ms(8)

    tenfold = {p: PolyCurve(10 * c.a, 10 * c.b) for p, c in SEED.items()}
    t = feed(m, tenfold, "eagle", range(1, 3), 0.0, n=200)
    assert m.model(t).baseline.ms(8) == pytest.approx(tenfold["baseline"].ms(8), rel=0.1)
    assert ratio(t) == pytest.approx(ratio(0.0), rel=0.02)
    t = feed(m, tenfold, "baseline", range(20, 60), t + 100.0, n=200)
    assert m.model(t).eagle.ms(8) == pytest.approx(tenfold["eagle"].ms(8), rel=0.1)
    assert ratio(t) == pytest.approx(ratio(0.0), rel=0.02)


def test_nonsense_readings_are_ignored() -> None:
    m = OnlineCostModel()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        m.observe("eagle", 4, bad, 1.0)
    assert m.learned(1.0)["eagle"].readings == 0


def test_sustained_load_is_time_weighted() -> None:
    s = SustainedLoad(tau_s=10.0)
    s.step(0.0, 1.0)
    s.step(0.5, 0.0)  # a half-second overlap moves it little
    assert s.at_time(0.5) == pytest.approx(1 - 2.718281828 ** -0.05, rel=1e-3)
    s.step(1.0, 6.0)
    assert s.at_time(100.0) == pytest.approx(6.0, rel=1e-3)


def test_sustained_load_falls_slower_than_it_rises() -> None:
    s = SustainedLoad(tau_s=5.0, fall_tau_s=30.0)
    s.step(0.0, 4.0)
    assert s.at_time(5.0) == pytest.approx(4 * (1 - math.exp(-1)))  # rising: 5 s
    s.step(50.0, 0.0)  # risen all the way; then a lull of 30 s
    assert s.at_time(80.0) == pytest.approx(4 * math.exp(-1), rel=1e-3)  # falling: 30 s
    both = SustainedLoad(tau_s=5.0)
    both.step(0.0, 4.0)
    both.step(50.0, 0.0)
    assert both.at_time(55.0) == pytest.approx(4 * math.exp(-1), rel=1e-3)


def test_inflight_history_busy_share_and_mean() -> None:
    h = InflightHistory()
    h.record(1.0, 1)
    h.record(3.0, 3)
    h.record(4.0, 0)
    assert h.busy_share(0.0, 4.0) == pytest.approx(0.75)
    assert h.mean(1.0, 5.0) == pytest.approx((2 * 1 + 1 * 3) / 4)
    assert h.busy_share(4.5, 5.0) == 0.0


def group_view() -> LoadView:
    v = LoadView(poll_interval=0.1)
    v.add_backend("e", "g", "eagle")
    v.add_backend("b", "g", "baseline")
    return v


def sample(at: float, rate: float, running: int = 4) -> EngineSample:
    return EngineSample(running, 0, at, gen_throughput=rate, max_running=48)


def test_windows_of_a_busy_engine_with_the_other_idle_are_solo_readings() -> None:
    v = group_view()
    learning = CostLearning(v)
    for _ in range(4):
        v.acquire("b", 0.0)
    learning.sample("b", sample(0.5, 100.0))  # first window seen: its start is unknown
    learning.sample("b", sample(0.6, 100.0))  # the same window again: counted once
    learning.sample("b", sample(1.5, 160.0))  # 4 requests at 160 tok/s: 25 ms steps
    fit = learning.learner("g").learned(1.5)["baseline"]
    assert fit.readings == 1 and fit.batch_range == (4.0, 4.0)
    # EAGLE-3 gets a request: the next window is mixed, not a baseline reading
    v.acquire("e", 1.5)
    learning.sample("b", sample(2.5, 150.0))
    assert learning.learner("g").learned(2.5)["baseline"].readings == 1


def baseline_step_read(prefill_tokens: float, ms_per_token: float = 0.02) -> float | None:
    """The step one 25 ms window of 4 baseline requests reads when the router sent
    `prefill_tokens` uncached prompt tokens to the engine within it (None: no reading)."""
    v = group_view()
    learning = CostLearning(v, prefill_ms_per_token=ms_per_token)
    for _ in range(4):
        v.acquire("b", 0.0)
    learning.sample("b", sample(0.5, 100.0))
    learning.admitted("b", 0.2, 5000.0)  # before the window: not in it
    learning.admitted("b", 1.0, prefill_tokens)
    learning.sample("b", sample(1.5, 160.0))  # 4 requests at 160 tok/s: 25 ms a window step
    fit = learning.learner("g")._fits["baseline"]
    mean = fit.mean()
    return None if mean is None else mean[1]


def test_a_window_is_read_net_of_the_prefill_sent_within_it() -> None:
    assert baseline_step_read(0.0) == pytest.approx(25.0)
    # 2,000 tokens at 0.02 ms: 40 ms of prefill among the window's 40 decode steps
    assert baseline_step_read(2000.0) == pytest.approx(24.0)
    assert baseline_step_read(2000.0, ms_per_token=0.0) == pytest.approx(25.0)
    # prefill estimated at 64% of the window: the step left is no reading
    assert baseline_step_read(32_000.0) is None


def test_a_windows_batch_is_what_the_engine_ran_not_what_waited() -> None:
    v = group_view()
    learning = CostLearning(v)
    for _ in range(8):  # 8 in flight, of which the engine runs 4 (4 wait or prefill)
        v.acquire("b", 0.0)
    learning.sample("b", sample(0.5, 100.0, running=4))
    learning.sample("b", sample(1.0, 100.0, running=4))  # polled within the window
    learning.sample("b", sample(1.5, 160.0, running=4))
    fit = learning.learner("g").learned(1.5)["baseline"]
    assert fit.batch_range == (4.0, 4.0)
    mean = learning.learner("g")._fits["baseline"].mean()
    assert mean is not None and mean[1] == pytest.approx(25.0)  # 4 x 1 token / 160 tok/s
    assert decode_batch(8.0, 0.0, None) == 8.0  # no running count polled: the router's
    assert decode_batch(8.0, 6.0, 5) == 5.0  # never past the cap


def test_a_window_with_an_idle_gap_is_no_reading() -> None:
    v = group_view()
    learning = CostLearning(v)
    v.acquire("b", 0.0)
    learning.sample("b", sample(0.1, 50.0, 1))
    v.release("b", 0.5)  # idle for most of the window: SGLang's rate counts the gap
    v.acquire("b", 1.9)
    learning.sample("b", sample(2.0, 20.0, 1))
    assert learning.learner("g").learned(2.0)["baseline"].readings == 0


def test_a_model_is_served_again_until_a_reading_or_a_thousandth_of_a_half_life() -> None:
    m = OnlineCostModel(half_life_s=300.0)
    m.observe("eagle", 2, 20.0, 0.0)
    built = m.model(1.0)
    assert m.model(1.2) is built and m.model(1.29) is built
    assert m.model(1.31) is not built  # 0.31 s past it: built again
    rebuilt = m.model(1.31)
    m.observe("eagle", 4, 25.0, 1.32)
    assert m.model(1.32) is not rebuilt


def test_the_traffic_context_is_the_recent_prompts_mean() -> None:
    v = group_view()
    learning = CostLearning(v)
    assert learning.traffic_context("g") is None
    learning.admitted("e", 0.0, 0.0, 0.0)  # a cost probe's or an unknown prompt
    assert learning.traffic_context("g") is None
    learning.admitted("e", 0.0, 500.0, 1000.0)
    learning.admitted("b", 0.0, 30000.0, 30000.0)
    assert learning.traffic_context("g") == pytest.approx(15500.0)
    # a minute later the old prompts weigh half as much as a new one
    learning.admitted("b", 60.0, 0.0, 31000.0)
    assert learning.traffic_context("g") == pytest.approx((0.5 * 31000.0 + 31000.0) / 2.0)


def test_a_seed_measured_at_several_contexts_is_read_at_the_traffics() -> None:
    """The seed-coding profile's model crosses over at ~1.7 requests at 1,024 prompt
    tokens and ~14 at 8,192: the learner reads it where the group's traffic decodes, and
    a reading there that matches the seed leaves its level as it is."""
    seed = profile_model("seed-coding")
    v = group_view()
    learning = CostLearning(v)
    learning.seed({"g": seed})
    learner = learning.learner("g")
    assert learner.model(0.0).crossover(2.0) == pytest.approx(seed.crossover(2.0))
    assert learner.model(0.0).context is None
    learning.admitted("e", 1.0, 30000.0, 30000.0)
    model = learner.model(1.0)
    assert model.context == 30000.0
    assert model.crossover(2.0) == pytest.approx(seed.at_context(30000).crossover(2.0))
    assert model.describe(2.0)["context_tokens"] == 30000
    # a small move of the traffic's context keeps the model; a larger one reads it again
    learning.admitted("e", 1.0, 31000.0, 31000.0)
    assert learner.model(1.0) is model
    learning.admitted("e", 1.0, 1000.0, 1000.0)
    assert learner.model(1.0).context == pytest.approx(62000.0 / 3)
    # a reading equal to the seed where the traffic is keeps the level at 1
    at = seed.at_context(learner.context)
    learner.observe("eagle", 4, at.eagle.ms(4), 2.0)
    assert learner.model(2.0).eagle.ms(8) == pytest.approx(at.eagle.ms(8))


def test_a_seed_without_a_context_axis_ignores_the_traffics_context() -> None:
    seed = GroupCostModel(SEED["baseline"], SEED["eagle"], 2.0, 256, 48)
    m = OnlineCostModel(seed)
    built = m.model(0.0)
    m.note_context(30000.0)
    assert m.model(0.0) is built and built.context is None
