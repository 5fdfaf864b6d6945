"""LoadAwareRouter with affinity, in process: sessions stay where their prefix is, and a
session on the baseline stays there when the group returns to EAGLE-3."""

from __future__ import annotations

import json
import random
from dataclasses import replace

from specrouter.backends import Backend
from specrouter.config import AdmissionSettings, AffinitySettings, HealthSettings, TelemetrySettings
from specrouter.control.holder import LocalPolicyHolder
from specrouter.observe.breaker import BreakerConfig
from specrouter.observe.health import HealthChecker
from specrouter.observe.loadview import EngineSample
from specrouter.routing.affinity.keys import prefix_keys
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.policy import Policy
from specrouter.routing.router import RequestInfo, Target

TWO_GROUPS = [Backend("g0-e", "http://h:1", "eagle", "g0"),
              Backend("g0-b", "http://h:2", "baseline", "g0"),
              Backend("g1-e", "http://h:3", "eagle", "g1"),
              Backend("g1-b", "http://h:4", "baseline", "g1")]
SETTINGS = AffinitySettings(block_bytes=1024)
APPLIED = AffinitySettings(block_bytes=1024, retention_applied=True)


class Hits:
    def __init__(self) -> None:
        self.affinity: list[bool] = []
        self.reasons: list[str] = []

    def observe_decision(self, pool: str, reason: str, group: str) -> None:
        self.reasons.append(reason)

    def observe_probe(self, backend: str) -> None: ...

    def observe_recall(self, group: str) -> None: ...

    def observe_handover(self, group: str) -> None: ...

    def observe_upstream_error(self, backend: str) -> None: ...

    def observe_affinity(self, hit: bool) -> None:
        self.affinity.append(hit)


def make(affinity: AffinitySettings | None, strategy: str = "threshold",
         **policy: object) -> tuple[LoadAwareRouter, Hits]:
    health = HealthChecker(TWO_GROUPS, HealthSettings(enabled=False),
                           BreakerConfig(failure_threshold=2, cooldown_s=5.0,
                                         success_threshold=1), clock=lambda: 0.0)
    monitor = BackendMonitor(TWO_GROUPS, health, TelemetrySettings(enabled=False),
                             clock=lambda: 0.0)
    hits = Hits()
    holder = LocalPolicyHolder(Policy.model_validate({"strategy": strategy, **policy}))
    router = LoadAwareRouter(monitor, holder,
                             AdmissionSettings(arrival_window_ms=0), metrics=hits,
                             rng=random.Random(7), affinity=affinity)
    return router, hits


def turn(session: int, n: int, header: str | None = None) -> RequestInfo:
    messages = [{"role": "system", "content": "You are a coding agent. " * 100},
                {"role": "user", "content": f"repository {session}: " + "src/x.py " * 9000}]
    for i in range(n):
        messages += [{"role": "assistant", "content": f"step {i} " * 50},
                     {"role": "user", "content": f"tool result {i} " * 80}]
    body = json.dumps({"messages": messages, "model": "m"}).encode()
    return RequestInfo("/v1/chat/completions", "m", True,
                       prefix=prefix_keys(body, SETTINGS.block_bytes, SETTINGS.bytes_per_token),
                       session=header)


def run_sessions(router: LoadAwareRouter) -> int:
    """8 sessions of 6 turns, interleaved, each turn in flight for a random while (so
    the loads differ at every decision); returns how many turns moved."""
    last: dict[int, str] = {}
    moves = 0
    inflight: list[Target] = []
    rng = random.Random(3)
    for n in range(6):
        for s in range(8):
            target = router.choose(turn(s, n))
            router.acquire(target)
            inflight.append(target)
            if s in last and last[s] != target.backend.name:
                moves += 1
            last[s] = target.backend.name
            while inflight and rng.random() < 0.5:
                router.release(inflight.pop(rng.randrange(len(inflight))))
    return moves


def test_multi_turn_sessions_stay_on_their_backend() -> None:
    router, hits = make(SETTINGS)
    assert run_sessions(router) == 0
    assert all(hits.affinity[8:])  # every turn after the first
    stats = router.live_view()["affinity"]
    assert stats["hit_share"] == round(hits.affinity.count(True) / 48, 4)
    assert sum(v["blocks"] for v in stats["index_blocks"].values()) > 0
    # the sessions spread over both groups
    assert {b: v["blocks"] > 0 for b, v in stats["index_blocks"].items()}["g1-e"]


def test_without_affinity_the_same_sessions_move() -> None:
    router, hits = make(None)
    assert run_sessions(router) > 0
    assert hits.affinity == []
    assert "affinity" not in router.live_view()


def test_a_session_moved_to_the_baseline_under_load_stays_there() -> None:
    router, _ = make(SETTINGS, switch_up=2, switch_down=0.5)
    load = [router.choose(RequestInfo("/v1/chat/completions")) for _ in range(4)]
    for t in load:
        router.acquire(t)
    t = router.choose(turn(0, 40))  # a long session arrives while its group is loaded
    assert (t.pool, t.reason) == ("baseline", "above_switch_up")
    group = t.group
    router.acquire(t)
    for x in load:
        router.release(x)
    router.release(t)
    t2 = router.choose(turn(0, 41))
    assert (t2.group, t2.backend.name, t2.reason) == (group, t.backend.name,
                                                      "affinity_hold_baseline")
    # a new session in the same, now idle, group goes to EAGLE-3
    t3 = router.choose(turn(99, 0))
    assert t3.pool == "eagle"


def test_a_handed_over_stream_follows_its_groups_switch_not_its_prefix() -> None:
    # The switch back to EAGLE-3 already chose to move the stream and paid its re-prefill
    # (the handover budget): the affinity hold must not send it back to its prefix.
    router, _ = make(SETTINGS, switch_up=2, switch_down=0.5)
    load = [router.choose(RequestInfo("/v1/chat/completions")) for _ in range(4)]
    for t in load:
        router.acquire(t)
    t = router.choose(turn(0, 40))
    router.acquire(t)
    for x in [*load, t]:
        router.release(x)
    elsewhere = frozenset(b.name for b in TWO_GROUPS if b.group != t.group)
    back = router.choose(RequestInfo("/v1/chat/completions", exclude=elsewhere))
    assert (back.group, back.pool, back.reason) == (t.group, "eagle", "below_switch_down")
    router.acquire(back)
    continued = replace(turn(0, 41), recalled=True, handed_over=True)
    moved = router.choose(continued)
    assert (moved.group, moved.pool, moved.reason) == (t.group, "eagle",
                                                       "hysteresis_hold_eagle")


def test_a_session_key_keeps_a_conversation_whose_history_was_rewritten() -> None:
    router, _ = make(SETTINGS)
    first = router.choose(turn(0, 3, header="conv-1"))
    router.acquire(first)  # its group is now the busier one
    # the client compacted the history: no block past the system prompt matches
    again = router.choose(turn(1, 0, header="conv-1"))
    assert again.backend.name == first.backend.name
    other = router.choose(turn(2, 0))  # without the key only the system prompt matches
    assert other.group != first.group


def test_the_router_bounds_each_index_by_the_reported_kv_pool() -> None:
    router, _ = make(SETTINGS)
    router.monitor._publish_sample("g0-e", EngineSample(0, 0, 0.0, kv_tokens=256 * 40))
    blocks = router.live_view()["affinity"]["index_blocks"]
    assert blocks["g0-e"]["capacity"] == 40
    assert blocks["g1-e"]["capacity"] == SETTINGS.cache_tokens // 256


def test_a_retry_is_indexed_on_its_new_backend_but_counted_once() -> None:
    router, hits = make(SETTINGS)
    first = router.choose(turn(0, 2))
    retry = router.choose(replace(turn(0, 2), exclude=frozenset({first.backend.name})))
    assert retry.backend.name != first.backend.name
    assert router.live_view()["affinity"]["requests"] == 1
    assert len(hits.affinity) == 1
    # the backend that answered is believed to hold the prompt
    assert router.live_view()["affinity"]["index_blocks"][retry.backend.name]["blocks"] > 0


def test_a_session_on_eagle_stays_there_when_its_group_turns_to_the_baseline() -> None:
    router, hits = make(SETTINGS, switch_up=2, switch_down=0.5)
    t = router.choose(turn(0, 40, header="conv-e"))  # an idle group: EAGLE-3
    assert t.pool == "eagle"
    router.acquire(t)
    for _ in range(6):  # both groups get busy
        router.acquire(router.choose(RequestInfo("/v1/chat/completions")))
    router.release(t)
    again = router.choose(turn(0, 41, header="conv-e"))
    # its group is loaded: the strategy says baseline, the prefix stays on EAGLE-3
    assert (again.backend.name, again.reason) == (t.backend.name, "affinity_hold_eagle")
    # the same prompt without its session key follows the strategy
    plain = router.choose(turn(0, 41))
    assert plain.group == t.group and plain.pool == "baseline"
    assert "affinity_hold_eagle" in hits.reasons


def test_a_session_counts_against_its_servers_cache_until_its_answer_ends() -> None:
    router, _ = make(SETTINGS.model_copy(update={"session_live_s": 5.0}))
    tracker = router._affinity
    assert tracker is not None
    clock = [0.0]
    tracker._clock = lambda: clock[0]
    t = router.choose(turn(0, 0, header="s0"))
    assert t.session == "s0"
    router.acquire(t)
    clock[0] = 60.0  # the answer streams for a minute
    other = tracker.lookup(turn(1, 0, header="s1").prefix, "s1")
    assert other is not None and other.footprint is not None
    assert other.footprint[t.backend.name] > 0
    router.release(t)
    clock[0] = 64.0
    assert tracker.lookup(None, "s1").footprint[t.backend.name] > 0  # type: ignore[union-attr]
    clock[0] = 66.0
    assert tracker.lookup(None, "s1").footprint[t.backend.name] == 0  # type: ignore[union-attr]


def test_a_turn_the_engine_reports_uncached_ends_the_sessions_hold() -> None:
    router, _ = make(APPLIED, switch_up=2, switch_down=0.5)
    load = [router.choose(RequestInfo("/v1/chat/completions")) for _ in range(4)]
    for t in load:
        router.acquire(t)
    t = router.choose(turn(0, 40, "s0"))
    assert (t.pool, t.reason, t.predicted_cached) == ("baseline", "above_switch_up", 0.0)
    router.acquire(t)
    for x in load:
        router.release(x)
    router.release(t)
    held = router.choose(turn(0, 41, "s0"))
    assert (held.backend.name, held.reason) == (t.backend.name, "affinity_hold_baseline")
    assert held.predicted_cached > 0.9
    # the baseline answered that turn with nothing of it cached: it evicted the session
    router.observe_cached(held, 40_000, 0)
    moved = router.choose(turn(0, 42, "s0"))
    assert (moved.pool, moved.reason) == ("eagle", "below_switch_down")
    retention = router.live_view()["affinity"]["retention"]
    assert retention[t.backend.name] == {"share": 0.8, "samples": 1, "applied": True}


def test_a_group_moving_onto_a_pool_has_its_servers_measured_anew() -> None:
    router, _ = make(SETTINGS, switch_up=2, switch_down=0.5)
    g0_base = TWO_GROUPS[1]
    for _ in range(5):  # the baseline evicted five turns before the group left it
        router.observe_cached(Target("g0", "baseline", g0_base, "x", predicted_cached=1.0),
                              40_000, 0)
    retention = router.live_view()["affinity"]["retention"]
    assert retention["g0-b"]["samples"] == 5 and retention["g0-b"]["share"] < 0.5
    targets = []
    while not any(t.group == "g0" and t.pool == "baseline" for t in targets):
        targets.append(router.choose(RequestInfo("/v1/chat/completions")))
        router.acquire(targets[-1])
        assert len(targets) < 20
    retention = router.live_view()["affinity"]["retention"]
    assert retention["g0-b"] == {"share": 1.0, "samples": 0, "applied": False}
