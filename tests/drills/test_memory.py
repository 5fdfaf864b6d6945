"""Memory under attack: what one hostile backend answer or a burst of large request bodies
can make the router hold is bounded by its limits, and each attack gets a clear error
(502 for a backend's answer over a limit, 503 with retry-after when the request-body budget
is spent). The router's peak resident memory (VmHWM) is read from /proc."""

from __future__ import annotations

import json

import pytest

from tests.drills.hostile import HostileBackend, fixed
from tests.drills.memory_attacks import (
    MIB,
    answers,
    bad_answer,
    held_until_the_gate_opens,
    large_bodies,
    peak_rss_mib,
    routed,
)
from tests.drills.test_abuse import assert_openai_error

ANSWER_LIMIT = 8 * MIB


@pytest.mark.parametrize("attack", sorted(answers()))
def test_a_hostile_answer_is_502_and_costs_at_most_its_limit(attack: str) -> None:
    limits = {"max_response_body_bytes": ANSWER_LIMIT}
    with routed(answers()[attack], {"SPECROUTER_LIMITS": json.dumps(limits)}) as (router, backend):
        idle = peak_rss_mib(router)
        error = assert_openai_error(bad_answer(router, timeout=20.0), 502)
        assert "limit" in str(error["message"]) or "unreachable" in str(error["message"])
        if "endless" in attack:
            assert backend.cut.wait(10.0)  # the router closed the upstream connection
        # the whole body limit plus a read buffer and the allocator's slack; unbounded,
        # an endless body reached hundreds of MiB
        assert peak_rss_mib(router) - idle < 2 * ANSWER_LIMIT / MIB + 16


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    huge = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: 10737418240\r\n\r\n{")
    with routed(fixed(huge)) as (router, _):
        error = assert_openai_error(bad_answer(router), 502)
        assert "10737418240 bytes exceeds" in str(error["message"])


def test_request_bodies_held_at_once_are_bounded_by_the_budget() -> None:
    size, budget, clients = 8 * MIB, 32 * MIB, 12
    limits = {"max_body_bytes": 16 * MIB, "max_inflight_body_bytes": budget}
    # Without the per-attempt `rid` (abort.with_rid copies the body once more): this
    # measures the read-and-forward path, which holds one copy.
    env = {"SPECROUTER_LIMITS": json.dumps(limits), "SPECROUTER_UPSTREAM__ABORT_ABANDONED": "false"}
    holder: list[HostileBackend] = []
    with routed(held_until_the_gate_opens(holder), env) as (router, backend):
        holder.append(backend)
        idle = peak_rss_mib(router)
        fits = budget // size  # the backend holds these until every other one is refused
        answers = large_bodies(router, backend, clients, size,
                               lambda done: len(backend.received) >= fits
                               and len(done) >= clients - fits)
        peak = peak_rss_mib(router) - idle
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [200] * fits + [503] * (clients - fits), statuses
        refused = [r for r in answers if r.status_code == 503]
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert {r.json()["error"]["code"] for r in refused} == {"overloaded"}
        # one copy of each body held (32 MiB) plus uvicorn's read buffers; at 2.6 copies
        # per body (a join per hop) this was over 80 MiB
        assert peak < budget / MIB * 1.5, peak
        assert [r.status_code for r in large_bodies(  # the budget was given back
            router, backend, fits, size, lambda done: len(done) >= fits)] == [200] * fits
