"""The simulator answers in each SGLang release's shapes, field for field.

tests/sim/conformance/sglang-<version>.json holds one sample per endpoint, written from that
release's source (each sample names its file and lines). A simulator answer matches a sample
when it has exactly the same keys, in the same order, at every level, with values of the same
JSON types; texts (SSE error events, empty bodies) must be byte-identical.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from tests.fixtures.sim import SimEngine, SimGroup

CONFORMANCE = Path(__file__).parent / "conformance"
VERSIONS = ("0.5.23", "0.5.10")
CHAT = [{"role": "user", "content": "hello"}]


def _samples(version: str) -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads(
        (CONFORMANCE / f"sglang-{version}.json").read_text())["samples"]
    return data


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def assert_same_shape(actual: Any, sample: Any, path: str = "$") -> None:
    assert _kind(actual) == _kind(sample), f"{path}: {actual!r} vs sample {sample!r}"
    if isinstance(sample, dict):
        assert list(actual) == list(sample), f"{path}: keys {list(actual)} vs {list(sample)}"
        for key in sample:
            assert_same_shape(actual[key], sample[key], f"{path}.{key}")
    elif isinstance(sample, list) and sample:
        assert actual, f"{path}: empty list, sample has items"
        for item in actual:
            assert_same_shape(item, sample[0], f"{path}[]")


@pytest.fixture(params=VERSIONS)
def versioned(request: pytest.FixtureRequest, sim_group: Callable[..., SimGroup]
              ) -> tuple[SimGroup, dict[str, dict[str, Any]]]:
    version: str = request.param
    return sim_group(time_scale=0.02, sglang_version=version), _samples(version)


def _events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with loopback.stream("POST", f"{url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[6:]) for line in lines]


def test_loads_and_metrics_match_the_release(sim_group: Callable[..., SimGroup]) -> None:
    for version in VERSIONS:
        samples = _samples(version)
        group = sim_group(time_scale=0.02, sglang_version=version)
        # 200 tokens at accept length 2 are ~100 decode batches: past the first 40-batch fold
        loopback.post(f"{group.eagle_url}/v1/completions", timeout=30, json={
            "model": "m", "prompt": "p", "max_tokens": 200, "ignore_eos": True}).raise_for_status()
        loads = loopback.get(f"{group.eagle_url}/v1/loads").json()
        assert_same_shape(loads, samples["v1_loads"]["sample"])
        assert loads["version"] == version
        get_load = loopback.get(f"{group.eagle_url}/get_load")
        assert get_load.status_code == samples["get_load"]["status"]
        assert_same_shape(get_load.json(), samples["get_load"]["sample"])
        ready = loopback.get(f"{group.eagle_url}/ready")
        assert ready.status_code == samples["ready"]["status"]
        if "text" in samples["ready"]:
            assert ready.text == samples["ready"]["text"]
        else:
            assert ready.json() == samples["ready"]["sample"]
        families = {f.name: f for f in text_string_to_metric_families(
            loopback.get(f"{group.eagle_url}/metrics").text)}
        scheduler = samples["metrics_scheduler_labels"]["labels"]
        tokenizer = samples["metrics_tokenizer_labels"]
        assert sorted(families["sglang:num_running_reqs"].samples[0].labels) == scheduler
        assert sorted(families["sglang:spec_accept_length"].samples[0].labels) == scheduler
        assert sorted(families["sglang:num_requests"].samples[0].labels) == \
            tokenizer["counter_labels"]
        assert sorted(families["sglang:num_aborted_requests"].samples[0].labels) == \
            tokenizer["aborted_labels"]
        group.process.stop()


def test_chunks_errors_and_aborts_match_the_release(
        versioned: tuple[SimGroup, dict[str, dict[str, Any]]]) -> None:
    group, samples = versioned
    url = group.baseline_url
    events = _events(url, "/v1/chat/completions", {
        "model": "m", "messages": CHAT, "max_tokens": 3, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    role, *contents, finish, usage = events
    assert_same_shape(role, samples["chat_role_chunk"]["sample"])
    assert contents
    for chunk in contents:
        assert_same_shape(chunk, samples["chat_content_chunk"]["sample"])
    assert_same_shape(finish, samples["chat_finish_chunk"]["sample"])
    assert_same_shape(usage, samples["chat_usage_chunk"]["sample"])
    completion = _events(url, "/v1/completions", {
        "model": "m", "prompt": "p", "max_tokens": 3, "ignore_eos": True, "stream": True})
    sample = samples["completion_final_chunk"]["sample"]
    assert_same_shape(completion[-1], sample)
    for chunk in completion[:-1]:  # finish_reason null
        assert list(chunk) == list(sample)
        assert list(chunk["choices"][0]) == list(sample["choices"][0])
    assert completion[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in completion[:-1])
    assert "".join(c["choices"][0]["text"] for c in completion)  # no empty finish chunk
    invalid = loopback.post(f"{url}/v1/chat/completions", json={"model": "m"})
    assert invalid.status_code == samples["validation_error"]["status"]
    assert_same_shape(invalid.json(), samples["validation_error"]["sample"])
    assert invalid.json()["type"] == samples["validation_error"]["sample"]["type"]
    aborted = loopback.post(f"{url}/abort_request", json={"rid": "nobody"})
    assert aborted.status_code == samples["abort_request"]["status"]
    assert aborted.text == samples["abort_request"]["text"]


@pytest.mark.parametrize("version", VERSIONS)
def test_queue_full_matches_the_release(sim_group: Callable[..., SimGroup], version: str) -> None:
    # --max-queued-requests 0: every request finds the queue full
    group = sim_group(time_scale=0.02, sglang_version=version,
                      extra_args=("--max-queued-requests", "0"))
    samples = _samples(version)
    body = {"model": "m", "messages": CHAT, "max_tokens": 3}
    refused = loopback.post(f"{group.baseline_url}/v1/chat/completions", json=body, timeout=10)
    expected = samples["queue_full_non_stream"]
    assert refused.status_code == expected["status"] and refused.json() == expected["sample"]
    with loopback.stream("POST", f"{group.baseline_url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        assert response.read().decode() == samples["queue_full_stream"]["text"]


@pytest.mark.parametrize("version", VERSIONS)
def test_cache_report_usage_matches_the_release(
        version: str, sim_engine: Callable[..., SimEngine]) -> None:
    engine = sim_engine("baseline", time_scale=0.02, sglang_version=version,
                        extra_args=("--enable-cache-report",))
    body = {"model": "m", "messages": CHAT, "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    _events(engine.url, "/v1/chat/completions", body)
    usage = _events(engine.url, "/v1/chat/completions", body)[-1]  # the same prompt: a hit
    assert_same_shape(usage, _samples(version)["chat_usage_chunk_cache_report"]["sample"])
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        usage["usage"]["prompt_tokens"] - 1  # all but the last token (SGLang's match limit)
