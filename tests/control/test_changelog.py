"""PolicyChangeLog: the guarantees every PolicyHolder gives its subscribers and history."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import pytest

from specrouter.control.changelog import PolicyChange, PolicyChangeLog
from specrouter.control.holder import LocalPolicyHolder
from specrouter.routing.policy import Policy


def _change(old: int, new: int) -> PolicyChange:
    return PolicyChange(Policy(version=old), Policy(version=new), datetime.now(UTC), "patch")


def test_a_failing_listener_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    changes = PolicyChangeLog()
    seen: list[tuple[int, int]] = []

    def broken(old: Policy, new: Policy) -> None:
        raise RuntimeError("listener bug")

    changes.subscribe(broken)
    changes.subscribe(lambda old, new: seen.append((old.version, new.version)))
    with caplog.at_level(logging.INFO, logger="specrouter.control.changelog"):
        changes.record(_change(1, 2))
    assert seen == [(1, 2)]
    assert "policy listener" in caplog.text and "listener bug" in caplog.text
    assert "policy changed (patch by admin) to version 2" in caplog.text


def test_unsubscribe_stops_calls_and_is_idempotent() -> None:
    changes = PolicyChangeLog()
    seen: list[int] = []
    unsubscribe = changes.subscribe(lambda old, new: seen.append(new.version))
    changes.record(_change(1, 2))
    unsubscribe()
    unsubscribe()
    changes.record(_change(2, 3))
    assert seen == [2]


def test_history_is_bounded_newest_first_and_skips_changes_not_kept() -> None:
    changes = PolicyChangeLog(size=2)
    for version in (2, 3, 4):
        changes.record(_change(version - 1, version))
    changes.record(_change(4, 7), keep=False)
    assert [c.new.version for c in changes.history()] == [4, 3]
    assert changes.find(3) is not None and changes.find(2) is None and changes.find(7) is None


def test_local_holder_keeps_a_change_a_listener_failed_on() -> None:
    holder = LocalPolicyHolder(Policy())

    def broken(old: Policy, new: Policy) -> None:
        raise RuntimeError("listener bug")

    holder.subscribe(broken)
    change = asyncio.run(holder.patch({"mode": "eagle"}, actor="test"))
    assert holder.current is change.new and holder.current.mode == "eagle"
    assert holder.history() == [change]
