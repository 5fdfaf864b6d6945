"""Every SGLang endpoint of the simulator answers with SGLang's fields and status codes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from specrouter.sim.server import SGLANG_KEEP_ALIVE_S
from tests.fixtures.sim import SimGroup

LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}


@pytest.fixture
def group(sim_group: Callable[..., SimGroup]) -> SimGroup:
    return sim_group(time_scale=0.02)


def _generate_some(url: str) -> None:
    # 200 tokens at accept length 2: ~100 decode batches, past SGLang's first 40-batch fold
    body = {"model": "m", "prompt": "hello " * 50, "max_tokens": 200, "ignore_eos": True}
    assert loopback.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200


def test_info_endpoints(group: SimGroup) -> None:
    url = group.eagle_url
    models = loopback.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    model = models["data"][0]
    assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(model)
    assert model["owned_by"] == "sglang" and model["object"] == "model"
    for path in ("/model_info", "/get_model_info"):
        info = loopback.get(f"{url}{path}").json()
        assert {"model_path", "tokenizer_path", "is_generation"} <= set(info)
    _generate_some(url)
    for path in ("/server_info", "/get_server_info"):
        info = loopback.get(f"{url}{path}").json()
        assert info["speculative_algorithm"] == "EAGLE3" and "version" in info
        assert info["max_running_requests"] == 48
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0
        assert "last_gen_throughput" in info["internal_states"][0]
    baseline_info = loopback.get(f"{group.baseline_url}/server_info").json()
    assert baseline_info["speculative_algorithm"] is None
    assert "avg_spec_accept_length" not in baseline_info["internal_states"][0]


def test_health_and_ready(group: SimGroup) -> None:
    for pool in ("eagle", "baseline"):
        assert loopback.get(f"{group.url(pool)}/health", timeout=10).status_code == 200
        assert loopback.get(f"{group.url(pool)}/health_generate", timeout=10).status_code == 200
        ready = loopback.get(f"{group.url(pool)}/ready")
        assert ready.status_code == 200 and ready.content == b""  # 0.5.23, the default


@pytest.mark.parametrize("version", ["0.5.23", "0.5.10"])
def test_loads_and_get_load(sim_group: Callable[..., SimGroup], version: str) -> None:
    group = sim_group(time_scale=0.02, sglang_version=version)
    _generate_some(group.eagle_url)
    loads = loopback.get(f"{group.eagle_url}/v1/loads?include=core,spec,queues").json()
    entry = loads["loads"][0]
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                "max_total_num_tokens", "max_running_requests", "token_usage",
                "gen_throughput"):
        assert key in entry, key
    assert entry["speculative"]["accept_length"] > 1.0
    assert "memory" not in entry  # sections not asked for are left out, as in SGLang
    base = loopback.get(f"{group.baseline_url}/v1/loads").json()["loads"][0]
    assert "speculative" not in base and "memory" in base
    bad = loopback.get(f"{group.eagle_url}/v1/loads?include=bogus")
    load = loopback.get(f"{group.eagle_url}/get_load")
    if version == "0.5.23":
        assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        assert entry["dp_rank"] == 0 and isinstance(entry["timestamp"], float)
        assert bad.status_code == 500  # LoadSnapshot.to_dict raises outside the route's try
        assert load.status_code == 404
    else:
        assert set(loads) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
        assert "dp_rank" not in entry and entry["num_total_reqs"] == 0
        assert bad.status_code == 400 and bad.json()["type"] == "400"
        assert load.json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                "num_tokens": 0}]


def test_metrics_parse_with_sglang_names(group: SimGroup) -> None:
    _generate_some(group.eagle_url)
    text = loopback.get(f"{group.eagle_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for gauge in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                  "sglang:gen_throughput", "sglang:cache_hit_rate", "sglang:spec_accept_length",
                  "sglang:spec_accept_rate"):
        assert families[gauge].type == "gauge", gauge
        assert set(families[gauge].samples[0].labels) == LABELS
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert set(families["sglang:num_requests"].samples[0].labels) == {
        "model_name", "engine_type", "is_streaming"}  # the tokenizer's labels (0.5.23)
    assert samples["sglang:num_requests_total"].value >= 1
    assert samples["sglang:generation_tokens_total"].value >= 200
    assert samples["sglang:prompt_tokens_total"].value >= 75
    assert samples["sglang:num_aborted_requests_total"].value == 0
    assert samples["sglang:spec_accept_length"].value > 1.0
    for hist in ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:e2e_request_latency_seconds"):
        assert families[hist].type == "histogram"
        assert samples[f"{hist}_count"].value >= 1


def test_generate_native(group: SimGroup) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 7,
                                                                    "ignore_eos": True}}
    out = loopback.post(f"{group.baseline_url}/generate", json=body, timeout=30).json()
    assert out["meta_info"]["completion_tokens"] == 7
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert out["text"]
    with loopback.stream("POST", f"{group.baseline_url}/generate", json={**body, "stream": True},
                      timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert lines[-2].startswith("data: {") and '"completion_tokens":7' in lines[-2]


def test_errors_are_flat(group: SimGroup) -> None:
    url = f"{group.eagle_url}/v1/chat/completions"
    bad = loopback.post(url, json={"model": "m"})
    assert bad.status_code == 400
    body = bad.json()
    # request validation: FastAPI's RequestValidationError handler, type HTTPStatus phrase
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"
    assert set(body) == {"object", "message", "type", "param", "code"}
    form = loopback.post(url, content=b"{}", headers={"content-type": "text/plain"})
    assert form.status_code == 400 and "application/json" in form.json()["message"]
    not_json = loopback.post(url, content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400
    too_long = loopback.post(url, json={"model": "m", "max_tokens": 10**7,
                                        "messages": [{"role": "user", "content": "x"}]})
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["message"]
    assert too_long.json()["type"] == "BadRequestError"  # a ValueError from the tokenizer


def test_stop_strings_and_eos(group: SimGroup) -> None:
    url = f"{group.baseline_url}/v1/completions"
    full = loopback.post(url, json={"model": "m", "prompt": "p", "max_tokens": 40,
                                 "ignore_eos": True}, timeout=30).json()
    text = full["choices"][0]["text"]
    stop = text[10:14]
    cut = loopback.post(url, json={"model": "m", "prompt": "p", "max_tokens": 40,
                                "ignore_eos": True, "stop": [stop]}, timeout=30).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["matched_stop"] == stop
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    # without ignore_eos the profile's output-length distribution decides, capped by max_tokens
    lengths = {loopback.post(url, json={"model": "m", "prompt": f"q{i}", "max_tokens": 2000},
                          timeout=60).json()["usage"]["completion_tokens"] for i in range(5)}
    assert len(lengths) > 1 and max(lengths) <= 2000


def test_api_key(sim_group: Callable[..., SimGroup]) -> None:
    group = sim_group(api_key="sekret-key")
    url = group.eagle_url
    denied = loopback.get(f"{url}/v1/models")
    assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
    assert loopback.post(f"{url}/v1/chat/completions", json={}).status_code == 401
    assert loopback.get(f"{url}/v1/models",
                     headers={"Authorization": "Bearer sekret-key"}).status_code == 200
    assert loopback.get(f"{url}/metrics").status_code == 200
    assert loopback.get(f"{url}/health", timeout=10).status_code == 200
    assert "sekret-key" not in " ".join(group.process.argv)
    assert "sekret-key" not in loopback.get(
        f"{url}/server_info", headers={"Authorization": "Bearer sekret-key"}).text


def test_an_idle_keep_alive_connection_is_closed_after_sglang_s_timeout(
        group: SimGroup) -> None:
    """SGLang closes a keep-alive connection idle for `SGLANG_TIMEOUT_KEEP_ALIVE` (5 s):
    a router's idle pool meets those closes, and so must it against the simulator."""
    host, port = group.eagle_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nhost: sim\r\n\r\n")
        answered = conn.recv(65536)
        assert answered.startswith(b"HTTP/1.1 200")
        idle_from = time.monotonic()
        while conn.recv(65536):  # the rest of the answer, then the server's close (EOF)
            pass
        idle_s = time.monotonic() - idle_from
    assert SGLANG_KEEP_ALIVE_S - 0.5 <= idle_s < 3 * SGLANG_KEEP_ALIVE_S, idle_s


def _residence(url: str) -> dict[str, list[list[float | None]]]:
    stays: dict[str, list[list[float | None]]] = loopback.get(
        f"{url}/sim/residence", timeout=5).json()["stays"]
    return stays


def test_residence_is_each_request_s_stay_before_its_first_token(group: SimGroup) -> None:
    url = group.baseline_url
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True}
    before = time.perf_counter()
    answered = loopback.post(f"{url}/v1/chat/completions", json=chat, timeout=30,
                             headers={"x-request-id": "answered"})
    after = time.perf_counter()
    assert answered.status_code == 200
    assert loopback.post(f"{url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
    [[submitted, first, left]] = _residence(url)["answered"]
    assert first is not None and left is None
    assert before < submitted < first < after  # one clock with the client's
    assert list(_residence(url)) == ["answered"]  # a request without the id keeps none

    # A stream whose client leaves while it waits in the queue: its stay ends then.
    loopback.post(f"{url}/sim/control", json={"wedged": True}, timeout=5)
    body = json.dumps({**chat, "max_tokens": 64}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as leaving:
        leaving.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\nx-request-id: left\r\n"
                        b"content-length: %d\r\n\r\n%b" % (len(body), body))
        deadline = time.monotonic() + 10
        while "left" not in _residence(url):
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while (stay := _residence(url)["left"][0])[2] is None:
        assert time.monotonic() < deadline, f"the stay never ended: {stay}"
        time.sleep(0.02)
    assert stay[1] is None and stay[0] < stay[2]
    loopback.post(f"{url}/sim/control", json={"wedged": False}, timeout=5)
