"""One policy for three replicas: a write on any is in force on all within 1 s; concurrent
PATCHes on different replicas never lose an update; an invalid document in Redis is ignored."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.cluster.conftest import ClusterFactory, Replica
from tests.fixtures.procs import wait_until


def test_write_on_one_replica_in_force_on_all_within_a_second(replicas: ClusterFactory) -> None:
    c = replicas(policy={"switch_up": 20, "switch_down": 10})
    # Startup: the replicas agreed on one policy, seeded once.
    assert {r.version() for r in c.replicas} == {1}
    assert c.redis.client().llen(f"{c.prefix}:policy:audit") == 1

    writes: list[tuple[str, dict[str, Any]]] = [
        ("PATCH", {"switch_up": 30}), ("PUT", {"strategy": "overflow", "eagle_cap": 3})]
    for i, (method, body) in enumerate(writes):
        writer = c[i % 3]
        response = writer.write(method, body)
        assert response.status_code == 200, response.text
        version = response.json()["policy"]["version"]
        assert version == 2 + i
        written = time.monotonic()
        def in_force(r: Replica, v: int = version) -> bool:
            return r.version() == v

        c.wait_all(in_force, 1.0, f"version {version} on every replica within 1 s")
        took = time.monotonic() - written
        print(f"{method} on replica {i % 3}: version {version} on all 3 after {took:.3f} s")
        assert took < 1.0, took
        for r in c.replicas:
            policy = r.policy()["policy"]
            if method == "PATCH":
                assert (policy["switch_up"], policy["switch_down"]) == (30, 10)
            else:  # PUT replaces: switch_up back to its default
                assert (policy["strategy"], policy["eagle_cap"], policy["switch_up"]) == (
                    "overflow", 3, 16)


def test_concurrent_patches_on_different_replicas_are_all_applied(
    replicas: ClusterFactory,
) -> None:
    c = replicas()
    fields: list[dict[str, Any]] = [{"switch_up": 40}, {"eagle_cap": 5}, {"switch_down": 2},
              {"allow_client_override": True}, {"load_signal": "inflight"},
              {"strategy": "overflow"}]
    with ThreadPoolExecutor(len(fields)) as pool:
        answers = list(pool.map(lambda ib: c[ib[0] % 3].write("PATCH", ib[1]),
                                enumerate(fields)))
    assert [a.status_code for a in answers] == [200] * len(fields), [a.text for a in answers]
    versions = sorted(a.json()["policy"]["version"] for a in answers)
    assert versions == list(range(2, 2 + len(fields)))  # one version each, none lost
    final = 1 + len(fields)
    c.wait_all(lambda r: r.version() == final, 5.0, f"version {final} everywhere")
    for r in c.replicas:
        policy = r.policy()["policy"]
        for body in fields:
            for key, value in body.items():
                assert policy[key] == value, (key, policy)


def test_invalid_document_in_redis_is_ignored_and_overwritten(replicas: ClusterFactory) -> None:
    c = replicas(policy={"switch_up": 12, "switch_down": 6})
    r = c.redis.client()
    key = f"{c.prefix}:policy"
    # Someone writes a policy the router's validation refuses (switch_down >= switch_up).
    bad = {"switch_up": 4, "switch_down": 9, "mode": "auto"}
    r.hset(key, mapping={"doc": json.dumps(bad), "version": 2, "updated_at": time.time(),
                         "updated_by": "redis-cli"})
    r.publish(f"{c.prefix}:policy:changed", 2)
    # Every replica saw version 2 (the store adopted it) but kept version 1 in force.
    c.wait_all(lambda rep: rep.state()["policy_version"] == 2, 5.0, "store sees version 2")
    for rep in c.replicas:
        policy = rep.policy()["policy"]
        assert (policy["version"], policy["switch_up"], policy["switch_down"]) == (1, 12, 6)
    # The next valid write merges onto the policy in force and wins everywhere.
    answer = c[1].write("PATCH", {"eagle_cap": 7})
    assert answer.status_code == 200, answer.text
    assert answer.json()["policy"]["version"] == 3
    c.wait_all(lambda rep: rep.version() == 3, 5.0, "version 3 everywhere")
    for rep in c.replicas:
        policy = rep.policy()["policy"]
        assert (policy["switch_up"], policy["switch_down"], policy["eagle_cap"]) == (12, 6, 7)
    wait_until(lambda: json.loads(r.hget(key, "doc") or "{}").get("eagle_cap") == 7, 5.0,
               "redis holds the valid policy")


def test_fifty_concurrent_patches_over_three_replicas_are_all_applied(
    replicas: ClusterFactory,
) -> None:
    """A merge PATCH never conflicts with another PATCH: none of a burst gets a 409."""
    c = replicas()
    bodies: list[dict[str, Any]] = [{"switch_up": 20 + i} if i % 2 else {"eagle_cap": 1 + i}
                                    for i in range(50)]
    start = threading.Barrier(len(bodies))

    def write(i: int) -> httpx.Response:
        start.wait()  # all 50 leave together
        return c[i % 3].write("PATCH", bodies[i])

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(write, range(len(bodies))))
    statuses = [a.status_code for a in answers]
    print(f"50 concurrent PATCHes: {sorted(Counter(statuses).items())}")
    assert statuses == [200] * len(bodies), [a.text for a in answers if a.status_code != 200]
    versions = sorted(a.json()["policy"]["version"] for a in answers)
    assert versions == list(range(2, 2 + len(bodies)))  # one version each, none lost
    final = 1 + len(bodies)
    c.wait_all(lambda r: r.version() == final, 5.0, f"version {final} everywhere")
    audit = [json.loads(e) for e in c.redis.client().lrange(f"{c.prefix}:policy:audit", 0, -1)]
    assert sorted(e["version"] for e in audit if e["version"] > 1) == versions
    # the last write of each field is what is in force
    by_version = {a.json()["policy"]["version"]: body
                  for a, body in zip(answers, bodies, strict=True)}
    last = {key: value for v in sorted(by_version) for key, value in by_version[v].items()}
    for r in c.replicas:
        policy = r.policy()["policy"]
        assert {k: policy[k] for k in last} == last
