"""PolicyListeners: the guarantee every PolicyHolder gives its subscribers."""

from __future__ import annotations

import asyncio
import logging

import pytest

from specrouter.control.holder import LocalPolicyHolder, PolicyListeners
from specrouter.routing.policy import Policy


def test_a_failing_listener_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listeners = PolicyListeners()
    seen: list[tuple[int, int]] = []

    def broken(old: Policy, new: Policy) -> None:
        raise RuntimeError("listener bug")

    listeners.subscribe(broken)
    listeners.subscribe(lambda old, new: seen.append((old.version, new.version)))
    with caplog.at_level(logging.ERROR, logger="specrouter.routing.policy"):
        listeners.notify(Policy(version=1), Policy(version=2))
    assert seen == [(1, 2)]
    assert "policy listener" in caplog.text and "listener bug" in caplog.text


def test_unsubscribe_stops_calls_and_is_idempotent() -> None:
    listeners = PolicyListeners()
    seen: list[int] = []
    unsubscribe = listeners.subscribe(lambda old, new: seen.append(new.version))
    listeners.notify(Policy(version=1), Policy(version=2))
    unsubscribe()
    unsubscribe()
    listeners.notify(Policy(version=2), Policy(version=3))
    assert seen == [2]


def test_local_holder_keeps_a_change_a_listener_failed_on() -> None:
    holder = LocalPolicyHolder(Policy())

    def broken(old: Policy, new: Policy) -> None:
        raise RuntimeError("listener bug")

    holder.subscribe(broken)
    change = asyncio.run(holder.patch({"mode": "eagle"}, actor="test"))
    assert holder.current is change.new and holder.current.mode == "eagle"
    assert holder.history() == [change]
