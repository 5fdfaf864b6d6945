"""SGLang's semantics where the router decides: lifetime vs windowed accept length, late
aborts, explicit aborts, /health and /ready with a wedged scheduler, snapshot freshness,
priority series in /metrics, /generate's events."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.sim import SimEngine, SimGroup

LONG = {"model": "m", "prompt": "p", "max_tokens": 100000, "ignore_eos": True}


def _complete(url: str, tokens: int, **extra: Any) -> dict[str, Any]:
    response = loopback.post(f"{url}/v1/completions", timeout=60, json={
        "model": "m", "prompt": "p", "max_tokens": tokens, "ignore_eos": True, **extra})
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def _gauge(url: str, name: str) -> float:
    for family in text_string_to_metric_families(loopback.get(f"{url}/metrics").text):
        if family.name == name:
            return float(family.samples[0].value)
    raise AssertionError(f"{name} missing")


def _loads_entry(url: str) -> dict[str, Any]:
    entry: dict[str, Any] = loopback.get(f"{url}/v1/loads").json()["loads"][0]
    return entry


def test_accept_length_lifetime_in_loads_windowed_in_metrics(
        sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("eagle", time_scale=0.02)
    _complete(engine.url, 30)  # ~15 decode batches: no fold yet
    assert "speculative" not in _loads_entry(engine.url)
    engine.control(accept_length=3.5)
    _complete(engine.url, 1200)  # ~350 batches at 3.5
    lifetime = _loads_entry(engine.url)["speculative"]["accept_length"]
    assert lifetime == pytest.approx(3.5, abs=0.3)
    engine.control(accept_length=1.2)
    _complete(engine.url, 200)  # ~170 batches at 1.2: four folds
    after = _loads_entry(engine.url)["speculative"]["accept_length"]
    window = _gauge(engine.url, "sglang:spec_accept_length")
    assert window == pytest.approx(1.2, abs=0.15)  # the last 40 batches only
    assert after > 2.2  # the lifetime mean barely moved
    info = loopback.get(f"{engine.url}/server_info").json()["internal_states"][0]
    assert info["avg_spec_accept_length"] == pytest.approx(after, abs=0.05)
    loopback.post(f"{engine.url}/flush_cache").raise_for_status()
    _complete(engine.url, 2)  # a prefill publishes a fresh snapshot
    assert "speculative" not in _loads_entry(engine.url)  # reset until the next fold


@dataclass
class OpenStream:
    """A chat stream that has sent its first output; `lines` holds it open."""

    client: httpx.Client
    cm: Any
    lines: Iterator[str]

    def close(self) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def _open_stream(url: str, body: dict[str, Any]) -> OpenStream:
    client = loopback.client(timeout=30)
    cm = client.stream("POST", f"{url}/v1/chat/completions", json=body)
    lines = cm.__enter__().iter_lines()
    next(lines)
    return OpenStream(client, cm, lines)


CHAT_LONG = {"model": "m", "messages": [{"role": "user", "content": "go"}],
             "max_tokens": 100000, "ignore_eos": True, "stream": True}


@pytest.mark.parametrize(("version", "delay_sim_s"), [("0.5.23", 0.0), ("0.5.10", 2.0)])
def test_running_stream_abort_delay(sim_engine: Callable[..., SimEngine], version: str,
                                    delay_sim_s: float) -> None:
    scale = 0.2
    engine = sim_engine("baseline", time_scale=scale, sglang_version=version)
    stream = _open_stream(engine.url, CHAT_LONG)
    closed_at = time.monotonic()
    stream.close()
    wait_until(lambda: engine.state()["aborted"] == 1, 10, "abort counted")
    took = engine.state()["abort_times"][0] - closed_at
    assert delay_sim_s * scale <= took + 0.02 < delay_sim_s * scale + 0.3, took


def test_queued_request_is_noticed_at_the_4s_poll(sim_engine: Callable[..., SimEngine]) -> None:
    scale = 0.2  # the poll: 4 simulated seconds = 0.8 s real
    engine = sim_engine("eagle", time_scale=scale, extra_args=("--max-running-requests", "1"))
    stream = _open_stream(engine.url, CHAT_LONG)
    sent_at = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # a queued stream: no head, no byte
        loopback.post(f"{engine.url}/v1/chat/completions", json=CHAT_LONG,
                   timeout=httpx.Timeout(30, read=0.2))
    state = engine.state()
    assert state["waiting"] == 1 and state["aborted"] == 0  # still holds its queue place
    wait_until(lambda: engine.state()["aborted"] == 1, 10, "queued abort noticed")
    took = engine.state()["abort_times"][0] - sent_at
    assert 4 * scale - 0.05 <= took < 4 * scale + 0.5, took
    assert engine.state()["waiting"] == 0
    stream.close()


def test_abort_request_by_rid(sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("baseline", time_scale=0.2)
    result: dict[str, Any] = {}

    def run() -> None:
        result["body"] = loopback.post(f"{engine.url}/v1/completions", timeout=30,
                                    json={**LONG, "rid": "router-rid-1"}).json()

    worker = threading.Thread(target=run)
    worker.start()
    wait_until(lambda: engine.state()["running"] == 1, 10, "request running")
    answer = loopback.post(f"{engine.url}/abort_request", json={"rid": "router-rid-1"})
    assert answer.status_code == 200 and answer.content == b""
    worker.join(10)
    assert result["body"]["id"] == "router-rid-1"
    assert result["body"]["choices"][0]["finish_reason"] == "abort"
    assert engine.state()["running"] == 0 and engine.state()["aborted"] == 1


def test_health_skips_the_queue_and_a_wedged_scheduler_fails_it(
        sim_engine: Callable[..., SimEngine]) -> None:
    scale = 0.02
    engine = sim_engine("eagle", time_scale=scale, extra_args=("--max-running-requests", "1"))
    stream = _open_stream(engine.url, CHAT_LONG)
    assert engine.state()["running"] == 1  # busy: SGLang does not queue /health behind it
    started = time.monotonic()
    assert loopback.get(f"{engine.url}/health", timeout=10).status_code == 200
    took = time.monotonic() - started
    assert 1.0 * scale <= took < 2.5, took  # acked after the current batch, at the 1 s poll
    engine.control(wedged=True)
    assert loopback.get(f"{engine.url}/ready").status_code == 200  # /ready cannot tell
    steps = engine.state()["decode_steps"]
    assert loopback.get(f"{engine.url}/health", timeout=10).status_code == 503  # after 20 sim-s
    assert engine.state()["decode_steps"] == steps  # nothing moved
    ready = loopback.get(f"{engine.url}/ready")
    assert ready.status_code == 503 and ready.content == b""
    engine.control(wedged=False)
    assert loopback.get(f"{engine.url}/health", timeout=10).status_code == 200
    assert loopback.get(f"{engine.url}/ready").status_code == 200
    engine.control(starting=True)
    assert loopback.get(f"{engine.url}/health").status_code == 503
    assert loopback.get(f"{engine.url}/ready").status_code == 503
    stream.close()


def test_loads_snapshot_freshness_and_empty_reader(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.2, sglang_version="0.5.23")
    url = group.baseline_url
    stream = _open_stream(url, CHAT_LONG)
    # baseline steps of ~21 sim-ms: a snapshot every 15 batches, ~63 ms real at this scale
    stamps = set()
    for _poll in range(40):
        stamps.add(_loads_entry(url)["timestamp"])
        time.sleep(0.005)
    published = group.state("baseline")["loads_published"]
    assert 1 < len(stamps) <= published
    entry = _loads_entry(url)
    assert time.time() - entry["timestamp"] < 1.0  # the server clock
    stream.close()
    wait_until(lambda: group.state("baseline")["running"] == 0, 10, "idle")
    first = _loads_entry(url)["timestamp"]
    time.sleep(0.05)
    assert _loads_entry(url)["timestamp"] > first  # an idle scheduler publishes on every loop
    group.control("baseline", loads_reader_detached=True)
    assert loopback.get(f"{url}/v1/loads").json()["loads"] == []


def test_loads_live_on_0_5_10(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.2, sglang_version="0.5.10",
                      extra_args=("--max-running-requests", "1"))
    url = group.baseline_url
    stream = _open_stream(url, CHAT_LONG)
    with loopback.client(timeout=httpx.Timeout(30, read=0.3)) as other, \
            pytest.raises(httpx.ReadTimeout):
        other.post(f"{url}/v1/chat/completions", json=CHAT_LONG)
    entry = loopback.get(f"{url}/v1/loads").json()["loads"][0]
    assert entry["num_waiting_reqs"] == 1 and entry["num_running_reqs"] == 1
    assert "dp_rank" not in entry and "timestamp" not in entry
    assert loopback.get(f"{url}/v1/loads?dp_rank=0").json()["loads"] == []
    stream.close()


def test_priority_series_in_metrics(sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("baseline", time_scale=0.2,
                        extra_args=("--enable-priority-scheduling",))
    streams = [_open_stream(engine.url, {**CHAT_LONG, "priority": p}) for p in (1, 1, 2)]
    wait_until(lambda: engine.state()["decode_steps"] > 45, 20, "a decode log")
    families = {f.name: f for f in text_string_to_metric_families(
        loopback.get(f"{engine.url}/metrics").text)}
    running = {s.labels["priority"]: s.value for s in families["sglang:num_running_reqs"].samples}
    assert running == {"": 3.0, "1": 2.0, "2": 1.0}  # the total AND each priority
    assert families["sglang:token_usage"].samples[0].labels["priority"] == ""
    for stream in streams:
        stream.close()


def test_generate_events_and_spec_meta(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(time_scale=0.02)
    body = {"text": "q", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True},
            "stream": True}
    with loopback.stream("POST", f"{group.eagle_url}/generate", json=body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    finished = [e for e in events if e["meta_info"]["finish_reason"] is not None]
    assert len(finished) == 1 and finished[0] is events[-1]  # the final event once
    meta = events[-1]["meta_info"]
    assert meta["completion_tokens"] == 20
    assert meta["spec_accept_length"] == pytest.approx(20 / meta["spec_verify_ct"])
    assert {"spec_accept_rate", "spec_num_correct_drafts", "spec_num_proposed_drafts"} <= set(meta)
