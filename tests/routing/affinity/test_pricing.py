"""What a held prefix is worth against load (specrouter.routing.affinity.pricing)."""

from __future__ import annotations

from dataclasses import replace

from specrouter.routing.affinity.pricing import (
    AFFINITY_REASONS,
    AffinityPrices,
    GroupAffinity,
    hold_pool,
    keep_group_pool,
    leave_evicting_pool,
    placement_tokens,
    pool_saving_ms,
    switch_cost_ms,
)
from specrouter.routing.affinity.tracker import Lookup
from specrouter.routing.costmodel import PoolPrediction
from specrouter.routing.decision import Decision, GroupState
from tests.routing.helpers import group

PRICES = AffinityPrices(prefill_ms_per_token=0.02, load_ms=50.0, balance_abs=8.0,
                        balance_rel=2.0, expected_output_tokens=256,
                        eagle_saving_ms_per_token=2.0)


def test_a_held_prefix_is_worth_its_prefill_on_the_shared_gpu() -> None:
    a = GroupAffinity({"g0": 30_000.0}, 31_000.0, PRICES)
    # g0 holds 30k of 31k tokens at load 4; g1 holds nothing at load 2
    assert a.cost("g0", 4.0, 2.0) == 1000 * 0.02 * 5 + 4 * 50
    assert a.cost("g1", 2.0, 2.0) == 31_000 * 0.02 * 3 + 2 * 50
    assert a.cost("g0", 4.0, 2.0) < a.cost("g1", 2.0, 2.0)


def test_past_the_balance_guard_a_group_is_priced_as_holding_nothing() -> None:
    a = GroupAffinity({"g0": 30_000.0}, 31_000.0, PRICES)
    assert a.cost("g0", 2.0 * 3 + 8, 3.0) < a.cost("g0", 2.0 * 3 + 8.5, 3.0) / 10
    assert a.cost("g0", 14.5, 3.0) == 31_000 * 0.02 * 15.5 + 14.5 * 50


def test_with_nothing_held_the_less_loaded_group_is_cheaper() -> None:
    a = GroupAffinity({}, 5000.0, PRICES)
    assert a.cost("g0", 1.0, 1.0) < a.cost("g1", 2.0, 1.0)


def decision(pool: str, load: float = 3.0,
             predictions: dict[str, PoolPrediction] | None = None) -> Decision:
    return Decision(pool, f"strategy_{pool}", GroupState(pool), load,  # type: ignore[arg-type]
                    predictions, recalls=True)  # type: ignore[arg-type]


def look(held: dict[str, float], prompt: float = 0.0, session_backend: str | None = None,
         footprint: dict[str, float] | None = None,
         caches: dict[str, float] | None = None,
         retention: dict[str, float] | None = None) -> Lookup:
    return Lookup(held, max([prompt, *held.values()]), session_backend, footprint, caches,
                  retention=retention)


def test_a_session_on_the_baseline_stays_when_moving_costs_more_than_eagle_saves() -> None:
    g = group("g0")
    held = {"g0-base": 30_000.0, "g0-eagle": 2_000.0}
    out = hold_pool(decision("eagle"), g, look(held), PRICES)
    # 28k tokens x 0.02 ms x (1 + 3) = 2240 ms against 256 x 2 ms = 512 ms
    assert (out.pool, out.reason, out.recalls) == ("baseline", "affinity_hold_baseline", False)
    assert out.state == GroupState("eagle")  # the group's own state is the strategy's


def test_a_short_difference_moves_to_eagle() -> None:
    out = hold_pool(decision("eagle"), group("g0"), look({"g0-base": 5_000.0}), PRICES)
    assert (out.pool, out.reason) == ("eagle", "strategy_eagle")


def test_a_baseline_decision_is_followed_without_the_session() -> None:
    # a prefix shared with other requests (no session key, or the session was elsewhere)
    out = hold_pool(decision("baseline"), group("g0"), look({"g0-eagle": 90_000.0}), PRICES)
    assert (out.pool, out.reason) == ("baseline", "strategy_baseline")
    out = hold_pool(decision("baseline"), group("g0"),
                    look({"g0-eagle": 90_000.0}, session_backend="g1-eagle"), PRICES)
    assert (out.pool, out.reason) == ("baseline", "strategy_baseline")


def test_a_session_on_eagle_stays_when_moving_costs_more_than_the_baseline_saves() -> None:
    # 28k tokens x 0.02 ms x (1 + 3) = 2240 ms against 256 x (10 - 9) ms = 256 ms
    light = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 9.0)}
    out = hold_pool(decision("baseline", predictions=light), group("g0"),
                    look({"g0-eagle": 30_000.0, "g0-base": 2_000.0},
                         session_backend="g0-eagle"), PRICES)
    assert (out.pool, out.reason, out.recalls) == ("eagle", "affinity_hold_eagle", False)
    assert out.state == GroupState("baseline")
    # the baseline saving 20 ms per token (5120 ms) pays for the move
    heavy = {"eagle": pred("eagle", 29.0), "baseline": pred("baseline", 9.0)}
    out = hold_pool(decision("baseline", predictions=heavy), group("g0"),
                    look({"g0-eagle": 30_000.0, "g0-base": 2_000.0},
                         session_backend="g0-eagle"), PRICES)
    assert (out.pool, out.reason) == ("baseline", "strategy_baseline")
    assert pool_saving_ms("baseline", heavy, PRICES) == 20.0 * 256  # type: ignore[arg-type]
    # an EAGLE-3 engine measured to evict its sessions holds nothing to stay for
    d = decision("baseline", predictions=light)
    for server in ("g0-eagle", "g0-base"):
        evicting = look({"g0-eagle": 30_000.0, "g0-base": 2_000.0},
                        session_backend="g0-eagle", retention={server: 0.2})
        out = hold_pool(d, group("g0"), evicting, PRICES)
        assert out.pool == ("baseline" if server == "g0-eagle" else "eagle"), server


def test_a_new_session_goes_where_the_cache_has_room() -> None:
    # the baseline's cache is full of live sessions, EAGLE-3's is not: 20k tokens pushed
    # out come back as prefills, 20k x 0.02 x 4 = 1600 ms against 512 ms saved
    full = look({}, prompt=20_000.0, footprint={"g0-base": 100_000.0, "g0-eagle": 10_000.0},
                caches={"g0-base": 100_000.0, "g0-eagle": 100_000.0})
    out = hold_pool(decision("baseline"), group("g0"), full, PRICES)
    assert (out.pool, out.reason) == ("eagle", "affinity_room_eagle")
    roomy = look({}, prompt=20_000.0, footprint={"g0-base": 10_000.0, "g0-eagle": 10_000.0},
                 caches={"g0-base": 100_000.0, "g0-eagle": 100_000.0})
    assert hold_pool(decision("baseline"), group("g0"), roomy, PRICES).pool == "baseline"
    # without a session key (no footprint) the cache's room is not counted
    assert hold_pool(decision("baseline"), group("g0"), look({}, prompt=20_000.0),
                     PRICES).pool == "baseline"


def test_placement_counts_what_a_prompt_pushes_out_of_a_full_cache() -> None:
    caches = {"s": 100.0}
    assert placement_tokens(50.0, 0.0, {"s": 30.0}, caches, "s") == 50.0
    assert placement_tokens(50.0, 0.0, {"s": 80.0}, caches, "s") == 50.0 + 30.0
    # never more than its own uncached tokens: the rest were pushed out already
    assert placement_tokens(50.0, 10.0, {"s": 500.0}, caches, "s") == 40.0 + 40.0
    assert placement_tokens(50.0, 10.0, None, None, "s") == 40.0


def test_an_unhealthy_baseline_holds_nothing() -> None:
    out = hold_pool(decision("eagle"), group("g0", base_ok=False),
                    look({"g0-base": 30_000.0}), PRICES)
    assert out.pool == "eagle"


def pred(pool: str, tpot: float) -> PoolPrediction:
    return PoolPrediction(pool, 3.0, 3.0, 10.0, 100.0, tpot)  # type: ignore[arg-type]


def test_the_cost_models_saving_replaces_the_setting() -> None:
    preds = {"eagle": pred("eagle", 4.0), "baseline": pred("baseline", 40.0)}
    assert pool_saving_ms("eagle", preds, PRICES) == 36.0 * 256  # type: ignore[arg-type]
    # 2240 ms of prefill against 9216 ms saved: EAGLE-3 is worth the move
    out = hold_pool(decision("eagle", predictions=preds), group("g0"),
                    look({"g0-base": 30_000.0, "g0-eagle": 2_000.0}), PRICES)
    assert out.pool == "eagle"
    assert pool_saving_ms("eagle", None, PRICES) == 512.0
    assert switch_cost_ms(-5.0, 3.0, PRICES) == 0.0


def test_the_override_reasons_are_pool_decision_reasons() -> None:
    from specrouter.routing.pool_choice import REASONS
    assert set(AFFINITY_REASONS) <= set(REASONS)


def test_a_held_session_pays_for_running_beside_the_strategys_pool() -> None:
    light = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 9.0)}
    held = look({"g0-eagle": 30_000.0, "g0-base": 2_000.0}, session_backend="g0-eagle")
    # 8 requests on the baseline, EAGLE-3 otherwise idle: 8 x 256 x 10 ms = 20480 ms of
    # mixing against 2240 ms of prefill: the session moves to the baseline
    alone = hold_pool(decision("baseline", predictions=light), group("g0", base=8), held,
                      PRICES)
    assert (alone.pool, alone.reason) == ("baseline", "strategy_baseline")
    # with 19 more requests on EAGLE-3 the mixing goes on anyway: its share is 1024 ms
    shared = hold_pool(decision("baseline", predictions=light),
                       group("g0", eagle=19, base=8), held, PRICES)
    assert (shared.pool, shared.reason) == ("eagle", "affinity_hold_eagle")


def switching(to: str, load: float = 3.0,
              predictions: dict[str, PoolPrediction] | None = None) -> Decision:
    return Decision(to, f"strategy_{to}", GroupState(to, 50.0), load,  # type: ignore[arg-type]
                    predictions, recalls=True)  # type: ignore[arg-type]


def test_a_switch_that_moves_live_sessions_is_kept_back_while_their_prefill_costs_more(
) -> None:
    near = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 9.0)}
    live = look({}, prompt=30_000.0, footprint={"g0-eagle": 90_000.0, "g0-base": 0.0},
                caches={"g0-eagle": 4e5, "g0-base": 4e5})
    # three 30k sessions on EAGLE-3: 90k x 0.02 x (1 + 3) = 7200 ms of re-prefill against
    # (3 + 1 + 3) x 256 x 1 ms = 1792 ms saved: the group stays on EAGLE-3
    out = keep_group_pool(switching("baseline", predictions=near), "eagle", 7.0, group("g0"),
                          live, PRICES)
    assert (out.pool, out.reason, out.recalls) == ("eagle", "affinity_keep_eagle", False)
    assert (out.state.pool, out.state.since) == ("eagle", 7.0)
    # far past the crossover the baseline saves 30 ms a token: 53760 ms, the group switches
    far = {"eagle": pred("eagle", 40.0), "baseline": pred("baseline", 10.0)}
    out = keep_group_pool(switching("baseline", predictions=far), "eagle", 7.0, group("g0"),
                          live, PRICES)
    assert (out.pool, out.state.pool, out.reason) == ("baseline", "baseline", "strategy_baseline")


def test_a_switch_is_kept_back_while_the_sessions_servers_meet_the_tpot_objective() -> None:
    # far past the crossover (30 ms a token faster: the test above lets it through)
    far = {"eagle": pred("eagle", 40.0), "baseline": pred("baseline", 10.0)}
    footprint = {"g0-eagle": 90_000.0, "g0-base": 0.0}

    def switched(meeting: frozenset[str] | None) -> str:
        live = Lookup({}, 30_000.0, None, footprint, {"g0-eagle": 4e5, "g0-base": 4e5},
                      meeting_slo=meeting)
        out = keep_group_pool(switching("baseline", predictions=far), "eagle", 7.0,
                              group("g0"), live, PRICES)
        return f"{out.pool}/{out.reason}"

    # its answers meet the objective: the move's re-prefill buys nothing
    assert switched(frozenset({"g0-eagle"})) == "eagle/affinity_keep_eagle"
    # they do not (or the baseline's do, which is not where the sessions are): priced
    assert switched(frozenset()) == "baseline/strategy_baseline"
    assert switched(frozenset({"g0-base"})) == "baseline/strategy_baseline"
    # no objective set
    assert switched(None) == "baseline/strategy_baseline"


def test_a_switch_without_live_sessions_or_session_key_is_followed() -> None:
    near = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 9.0)}
    d = switching("baseline", predictions=near)
    # no live session on the old pool's server
    empty = look({}, prompt=30_000.0, footprint={"g0-base": 90_000.0}, caches={})
    assert keep_group_pool(d, "eagle", 7.0, group("g0"), empty, PRICES) is d
    # no session key: no footprint
    assert keep_group_pool(d, "eagle", 7.0, group("g0"), look({"g0-eagle": 3e4}), PRICES) is d
    # a strategy without predictions (threshold): nothing to weigh the re-prefill against
    live = look({}, prompt=30_000.0, footprint={"g0-eagle": 90_000.0}, caches={})
    blind = switching("baseline")
    assert keep_group_pool(blind, "eagle", 7.0, group("g0"), live, PRICES) is blind
    # not a switch: the group was already on the baseline
    live = look({}, prompt=30_000.0, footprint={"g0-base": 90_000.0}, caches={})
    assert keep_group_pool(d, "baseline", 7.0, group("g0"), live, PRICES) is d


def test_a_switch_onto_caches_too_small_for_the_live_sessions_is_kept_back() -> None:
    # the baseline saves 30 ms a token (53,760 ms against 7,200 ms of one re-prefill), but
    # EAGLE-3's 300k-token cache holds 250k of other live sessions: the 90k moved from the
    # baseline, which holds them, would evict each other before every turn
    far = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 40.0)}
    full = look({}, prompt=30_000.0, footprint={"g0-base": 90_000.0, "g0-eagle": 250_000.0},
                caches={"g0-eagle": 3e5, "g0-base": 4.5e5})
    out = keep_group_pool(switching("eagle", predictions=far), "baseline", 7.0, group("g0"),
                          full, PRICES)
    assert (out.pool, out.state.pool, out.reason) == ("baseline", "baseline",
                                                       "affinity_keep_baseline")
    # with room for them the switch goes
    roomy = look({}, prompt=30_000.0, footprint={"g0-base": 90_000.0, "g0-eagle": 50_000.0},
                 caches={"g0-eagle": 3e5, "g0-base": 4.5e5})
    d = switching("eagle", predictions=far)
    assert keep_group_pool(d, "baseline", 7.0, group("g0"), roomy, PRICES) is d
    # a pool that overflows already does not hold its sessions: the price alone decides
    over = look({}, prompt=30_000.0, footprint={"g0-base": 500_000.0, "g0-eagle": 250_000.0},
                caches={"g0-eagle": 3e5, "g0-base": 4.5e5})
    far_cheap = replace(d, load=0.0)
    assert keep_group_pool(far_cheap, "baseline", 7.0, group("g0"), over, PRICES).pool == "eagle"


def test_a_switch_away_from_servers_that_evict_their_sessions_is_not_kept_back() -> None:
    # the price alone keeps the group on EAGLE-3 (three 30k sessions: 7,200 ms of
    # re-prefill against 1,792 ms saved), but its engine reports a fifth of what the index
    # predicts cached: the sessions' next turns there re-prefill them anyway
    near = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 9.0)}
    d = switching("baseline", predictions=near)
    live = {"g0-eagle": 90_000.0, "g0-base": 0.0}
    caches = {"g0-eagle": 4e5, "g0-base": 4e5}
    evicting = look({}, prompt=30_000.0, footprint=live, caches=caches,
                    retention={"g0-eagle": 0.2, "g0-base": 1.0})
    assert keep_group_pool(d, "eagle", 7.0, group("g0"), evicting, PRICES) is d
    # but kept back where the baseline's caches cannot hold them either: both would thrash
    full = look({}, prompt=30_000.0, footprint={**live, "g0-base": 350_000.0},
                caches=caches, retention={"g0-eagle": 0.2})
    out = keep_group_pool(d, "eagle", 7.0, group("g0"), full, PRICES)
    assert (out.pool, out.reason) == ("eagle", "affinity_keep_eagle")
    # an engine that holds them (or is not measured yet) keeps the switch back as before
    for retention in ({"g0-eagle": 0.8}, {}, None):
        holding = look({}, prompt=30_000.0, footprint=live, caches=caches,
                       retention=retention)
        out = keep_group_pool(d, "eagle", 7.0, group("g0"), holding, PRICES)
        assert (out.pool, out.reason) == ("eagle", "affinity_keep_eagle")


def test_a_group_leaves_servers_that_evict_its_sessions_for_caches_with_room() -> None:
    # EAGLE-3 saves 1 ms a token: (3 + 1 + 3) x 256 = 1,792 ms per round of answers; its
    # engine reports a fifth of three 30k sessions cached, so each round re-prefills
    # 90k x 0.8 x 0.02 x (1 + 3) = 5,760 ms that the baseline's room would keep cached
    near = {"eagle": pred("eagle", 9.0), "baseline": pred("baseline", 10.0)}
    d = switching("eagle", predictions=near)  # the strategy keeps the group on EAGLE-3
    live = {"g0-eagle": 90_000.0, "g0-base": 0.0}
    caches = {"g0-eagle": 6e4, "g0-base": 4e5}
    evicting = look({}, prompt=30_000.0, footprint=live, caches=caches,
                    retention={"g0-eagle": 0.2})
    out = leave_evicting_pool(d, "eagle", group("g0"), evicting, PRICES, 80.0)
    assert (out.pool, out.reason, out.recalls) == ("baseline", "affinity_leave_eagle", True)
    assert (out.state.pool, out.state.since) == ("baseline", 80.0)
    # far below the crossover EAGLE-3 saves 20 ms a token (35,840 ms): it stays
    far = {"eagle": pred("eagle", 10.0), "baseline": pred("baseline", 30.0)}
    slow = switching("eagle", predictions=far)
    assert leave_evicting_pool(slow, "eagle", group("g0"), evicting, PRICES, 80.0) is slow


def test_a_group_stays_where_leaving_would_not_keep_its_sessions_cached() -> None:
    near = {"eagle": pred("eagle", 9.0), "baseline": pred("baseline", 10.0)}
    d = switching("eagle", predictions=near)
    live = {"g0-eagle": 90_000.0, "g0-base": 0.0}
    # the baseline's cache cannot hold the sessions either, or is not known
    for caches in ({"g0-eagle": 6e4, "g0-base": 8e4}, {"g0-eagle": 6e4}, None):
        small = look({}, prompt=30_000.0, footprint=live, caches=caches,
                     retention={"g0-eagle": 0.2})
        assert leave_evicting_pool(d, "eagle", group("g0"), small, PRICES, 80.0) is d
    roomy = {"g0-eagle": 6e4, "g0-base": 4e5}
    # EAGLE-3 holds what the index predicts, or is not measured: nothing to leave
    for retention in ({"g0-eagle": 0.8}, {}, None):
        holding = look({}, prompt=30_000.0, footprint=live, caches=roomy,
                       retention=retention)
        assert leave_evicting_pool(d, "eagle", group("g0"), holding, PRICES, 80.0) is d
    # the baseline's engine evicts its own sessions too
    both = look({}, prompt=30_000.0, footprint={**live, "g0-base": 30_000.0}, caches=roomy,
                retention={"g0-eagle": 0.2, "g0-base": 0.3})
    assert leave_evicting_pool(d, "eagle", group("g0"), both, PRICES, 80.0) is d
    # not the strategy keeping the group: a switch (keep_group_pool's case)
    evicting = look({}, prompt=30_000.0, footprint=live, caches=roomy,
                    retention={"g0-eagle": 0.2})
    s = switching("baseline", predictions=near)
    assert leave_evicting_pool(s, "eagle", group("g0"), evicting, PRICES, 80.0) is s
    # no session key (no footprint), or a strategy without predictions
    bare = look({"g0-eagle": 3e4}, retention={"g0-eagle": 0.2})
    assert leave_evicting_pool(d, "eagle", group("g0"), bare, PRICES, 80.0) is d
    blind = switching("eagle")
    assert leave_evicting_pool(blind, "eagle", group("g0"), evicting, PRICES, 80.0) is blind
