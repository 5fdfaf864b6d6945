"""Settings validation, URL redaction and the in-memory store (the single-replica default)."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from specrouter.state import (
    InMemoryStore,
    StateSettings,
    VersionConflict,
    make_store,
    redact_url,
)

pytestmark = pytest.mark.anyio


def test_defaults_meet_the_documented_bounds() -> None:
    s = StateSettings()
    assert s.redis_url is None and s.key_prefix == "specrouter"
    assert s.ttl_s <= 5.0
    assert s.reconcile_interval_s < 1.0  # a lost pub/sub message is healed within 1 s
    assert s.heartbeat_s <= s.ttl_s / 2


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://user:hunter2@localhost:6379", "must start with redis:// or rediss://"),
        ("localhost:6379", "must start with redis:// or rediss://"),
        ("redis://:hunter2@", "has no host"),
        ("redis://:hunter2@host:notaport", "not a valid URL"),
    ],
)
def test_bad_urls_are_refused_without_showing_the_password(url: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        StateSettings(redis_url=url)
    assert message in str(info.value)
    assert "hunter2" not in str(info.value)


def test_rediss_and_acl_user_urls_are_accepted_and_never_printed() -> None:
    s = StateSettings(redis_url="rediss://router:hunter2@redis.example:6380/2")
    assert s.redacted_url == "rediss://router:***@redis.example:6380/2"
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())


def test_redact_url() -> None:
    assert redact_url("redis://:p%40ss@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1") == "redis://h:1"
    assert "x" not in redact_url("redis://u:x@h:bad")


@pytest.mark.parametrize("prefix", ["a b", ":x", "x:", "x::y", ""])
def test_bad_key_prefix(prefix: str) -> None:
    with pytest.raises(ValidationError):
        StateSettings(key_prefix=prefix)


def test_heartbeat_must_fit_in_the_ttl() -> None:
    with pytest.raises(ValidationError, match="heartbeat_s"):
        StateSettings(ttl_s=1.0, heartbeat_s=0.8)


def test_bad_replica_id_is_refused() -> None:
    with pytest.raises(ValueError, match="replica_id"):
        make_store(StateSettings(), "has space")


async def test_memory_counts_never_negative_and_leases_release_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = make_store(StateSettings(), "solo")
    assert isinstance(store, InMemoryStore)
    await store.start()
    lease = store.acquire("gpu0/eagle")
    store.acquire("gpu0/eagle")
    assert store.cluster_inflight() == {"gpu0/eagle": 2}
    lease.release()
    lease.release()  # a disconnect racing the normal finish: still one release
    assert store.cluster_inflight() == {"gpu0/eagle": 1}
    store.release("gpu0/eagle")
    with caplog.at_level(logging.WARNING, logger="specrouter.state"):
        store.release("gpu0/eagle")
    assert store.cluster_inflight() == {}
    assert "below zero" in caplog.text
    await store.close()


async def test_memory_policy_cas_versions_and_audit_cap() -> None:
    store = make_store(StateSettings(audit_cap=3), "solo")
    seen: list[int] = []
    store.on_policy_change(lambda record: seen.append(record.version))
    first = await store.ensure_policy({"mode": "auto"})
    assert first.version == 1 and (await store.ensure_policy({"mode": "other"})).version == 1
    with pytest.raises(VersionConflict) as info:
        await store.put_policy({"mode": "x"}, expected_version=0)
    assert info.value.current == first
    for i in range(4):
        await store.put_policy({"n": i}, expected_version=1 + i, actor="admin")
    policy = store.get_policy()
    assert policy is not None and policy.version == 5 and policy.doc == {"n": 3}
    assert seen == [1, 2, 3, 4, 5]
    assert [e.version for e in await store.audit(10)] == [5, 4, 3]
    assert store.status()["backend"] == "memory"
    with pytest.raises(TypeError):
        await store.put_policy(["not", "an", "object"])  # type: ignore[arg-type]
