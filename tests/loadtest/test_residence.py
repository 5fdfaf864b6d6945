"""A request's time in the engines before its first token (`loadtest.residence`), and the
time to the first token with only that part converted to simulated time."""

from __future__ import annotations

import pytest

from loadtest.metrics import RequestResult, summarize
from loadtest.residence import attach_engine_time, engine_seconds


def test_a_stay_counts_from_its_submission_to_its_first_token() -> None:
    # sent at 10.0, first token at the client at 10.5; in the engine 10.1-10.4
    assert engine_seconds([[10.1, 10.4, None]], 10.0, 0.5) == pytest.approx(0.3)


def test_a_retried_request_sums_its_stays_and_an_open_one_ends_at_the_first_token() -> None:
    # recalled from one engine after 0.2 s (it left), then answered by another; a third
    # stay still open (a handover's continuation) counts only up to the client's token
    stays = [[10.0, None, 10.2], [10.25, 10.45, None]]
    assert engine_seconds(stays, 10.0, 0.5) == pytest.approx(0.4)
    assert engine_seconds([[10.1, None, None]], 10.0, 0.5) == pytest.approx(0.4)
    # nothing before the send or after the first token counts
    assert engine_seconds([[9.0, 9.5, None], [10.6, 10.9, None]], 10.0, 0.5) == 0.0


def test_the_deployed_ttft_converts_only_the_engines_part() -> None:
    answered = RequestResult(start=0.0, ok=True, ttft=0.05, e2e=0.2, output_tokens=4,
                             request_id="a", sent_at=100.0)
    unread = RequestResult(start=0.1, ok=True, ttft=0.05, e2e=0.2, output_tokens=4,
                           request_id="b", sent_at=100.1)
    attach_engine_time([answered, unread], {"a": [[100.002, 100.042, None]]})
    assert answered.engine_s == pytest.approx(0.04) and unread.engine_s is None
    # at time scale 0.1: 10 ms outside stay 10 ms, 40 ms inside stand for 400 ms
    assert answered.deployed_ttft(0.1) == pytest.approx(0.41)
    assert "ttft_deployed" not in summarize([answered, unread], time_scale=0.1)
    summary = summarize([answered], time_scale=0.1)
    assert summary["ttft_deployed"]["p99"] == pytest.approx(0.41)
    assert summary["ttft"]["p99"] == pytest.approx(0.5)
