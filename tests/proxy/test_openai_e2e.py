"""The drop-in promise: the real `openai` client, through the router, to simulated SGLang.

Every test starts its own simulated group and router (real processes on loopback) and
ends by checking that the router holds no request in flight: a leaked count would make
the load-aware policy see phantom load forever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest import loopback
from tests.fixtures.router import RoutedGroup

PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a function that reverses a list."},
]


@pytest.fixture
def group(routed_group: Callable[..., RoutedGroup]) -> Iterator[RoutedGroup]:
    """A fresh group and router: for tests that inject faults."""
    g = routed_group()
    yield g
    g.router.wait_idle()


@pytest.fixture
def shared_group(shared_routed_group: RoutedGroup) -> Iterator[RoutedGroup]:
    """The module's group and router: for tests that leave the engines as they found them."""
    yield shared_routed_group
    shared_routed_group.router.wait_idle()


def client(g: RoutedGroup, **kwargs: Any) -> openai.OpenAI:
    # max_retries=0: the client's own retries would hide what the router did.
    return openai.OpenAI(base_url=g.router.v1, api_key="unused", max_retries=0, timeout=30.0,
                         **kwargs)


def model_of(g: RoutedGroup) -> str:
    return str(client(g).models.list().data[0].id)


def test_chat_non_stream(shared_group: RoutedGroup) -> None:
    raw = client(shared_group).chat.completions.with_raw_response.create(
        model=model_of(shared_group), messages=PROMPT, max_tokens=12,
        extra_headers={"x-request-id": "req-42"},
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert raw.headers["x-specrouter-pool"] == "eagle"
    assert raw.headers["x-specrouter-backend"] == "gpu0-eagle"
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.headers["content-type"].startswith("application/json")


def test_chat_stream_with_include_usage(shared_group: RoutedGroup) -> None:
    stream = client(shared_group).chat.completions.create(
        model=model_of(shared_group), messages=PROMPT, max_tokens=16, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert text and finish in ("stop", "length")
    # include_usage: the stream ends with a usage chunk that has no choices.
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0
    assert stream.response.headers["x-specrouter-pool"] == "eagle"
    assert stream.response.headers["x-request-id"]  # a fresh one when the client sent none


def test_completions_stream_and_non_stream(shared_group: RoutedGroup) -> None:
    c, model = client(shared_group), model_of(shared_group)
    done = c.completions.create(model=model, prompt="def reverse(xs):", max_tokens=10)
    assert done.choices[0].text and done.usage is not None
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model=model, prompt="def reverse(xs):", max_tokens=10, stream=True) if ch.choices]
    assert "".join(pieces)


def test_chunks_arrive_as_they_are_generated(routed_group: Callable[..., RoutedGroup]) -> None:
    """No buffering: the first token reaches the client while its engine still decodes
    the rest of the answer (a buffering proxy sends nothing before the engine is done)."""
    g = routed_group(time_scale=0.5)
    raw = client(g).chat.completions.with_raw_response.create(
        model=model_of(g), messages=PROMPT, max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},
    )
    pool = raw.headers["x-specrouter-backend"].removeprefix("gpu0-")
    contents = (chunk for chunk in raw.parse() if chunk.choices and chunk.choices[0].delta.content)
    next(contents)
    at_first = g.state(pool)
    assert at_first["running"] == 1 and at_first["finished"] == 0, at_first
    assert len(list(contents)) >= 20
    assert g.state(pool)["finished"] == 1
    g.router.wait_idle()


def test_sglang_native_and_info_routes(shared_group: RoutedGroup) -> None:
    url = shared_group.router.url
    body = {"text": "def reverse(xs):", "sampling_params": {"max_new_tokens": 8}}
    plain = loopback.post(f"{url}/generate", json=body, timeout=30.0)
    assert plain.status_code == 200 and plain.json()["meta_info"]["completion_tokens"] > 0
    with loopback.stream("POST", f"{url}/generate", json={**body, "stream": True},
                      timeout=30.0) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        answer = loopback.get(f"{url}{path}", timeout=10.0)
        assert answer.status_code == 200, path
        assert answer.headers["x-specrouter-backend"].startswith("gpu0-")
    models = loopback.get(f"{url}/v1/models", timeout=10.0).json()
    ids = [m["id"] for m in models["data"]]
    assert len(ids) == len(set(ids)) == 1  # both engines serve one model: deduplicated
    assert loopback.get(f"{url}/v1/loads", timeout=10.0).headers["x-specrouter-pool"] == "baseline"


def test_health_and_ready(shared_group: RoutedGroup) -> None:
    assert loopback.get(f"{shared_group.router.url}/health").json() == {"status": "ok"}
    ready = loopback.get(f"{shared_group.router.url}/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert {b["name"] for b in ready.json()["backends"]} == {"gpu0-eagle", "gpu0-baseline"}


def test_upstream_errors_pass_through(group: RoutedGroup) -> None:
    c, model = client(group), model_of(group)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=model, messages=PROMPT, max_tokens=10**9)
    assert "maximum context length" in str(bad.value)
    assert bad.value.response.headers["x-specrouter-pool"] == "eagle"
    group.control("eagle", error_rate=1.0, error_status=500)
    with pytest.raises(openai.InternalServerError) as failed:
        c.chat.completions.create(model=model, messages=PROMPT, max_tokens=5)
    assert failed.value.status_code == 500  # 500 is not retried: it may not be transient
    assert "injected by the simulator" in str(failed.value)


def test_client_disconnect_aborts_upstream_within_100ms(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    g = routed_group(time_scale=0.5)
    body = {"model": "m", "messages": PROMPT, "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with loopback.client(timeout=30.0) as http, http.stream(
        "POST", f"{g.router.url}/v1/chat/completions", json=body
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data:") and '"content"' in line:
                break
        assert g.state("eagle")["running"] == 1
        closed_at = time.monotonic()
        response.close()
    deadline = time.monotonic() + 10
    while not g.state("eagle")["abort_times"] and time.monotonic() < deadline:
        time.sleep(0.01)
    state = g.state("eagle")
    assert state["aborted"] == 1 and state["running"] == 0
    delay = state["abort_times"][0] - closed_at
    assert delay < 0.100, f"the engine saw the abort {delay * 1000:.1f} ms after the close"
    g.router.wait_idle()


def test_connection_refused_before_first_byte_is_retried_on_baseline(
    group: RoutedGroup,
) -> None:
    group.control("eagle", refuse_connections=True)
    raw = client(group).chat.completions.with_raw_response.create(
        model="m", messages=PROMPT, max_tokens=5,
    )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-specrouter-pool"] == "baseline"
    assert group.state("baseline")["finished"] == 1


def test_503_before_first_byte_is_retried_once(group: RoutedGroup) -> None:
    group.control("eagle", error_rate=1.0, error_status=503)
    stream = client(group).chat.completions.create(
        model="m", messages=PROMPT, max_tokens=5, stream=True,
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert stream.response.headers["x-specrouter-pool"] == "baseline"
    group.control("baseline", error_rate=1.0, error_status=503)
    with pytest.raises(openai.APIStatusError) as both:  # once only: the second 503 stands
        client(group).chat.completions.create(model="m", messages=PROMPT, max_tokens=5)
    assert both.value.status_code in (502, 503)
    assert group.state("eagle")["requests"] + group.state("baseline")["requests"] <= 4


def test_mid_stream_failure_ends_with_an_error_event(group: RoutedGroup) -> None:
    group.control("eagle", cut_stream_after_tokens=3)
    body = {"model": "m", "messages": PROMPT, "max_tokens": 50, "stream": True,
            "ignore_eos": True}
    with loopback.stream("POST", f"{group.router.url}/v1/chat/completions", json=body,
                      timeout=30.0) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["object"] == "error" and error["code"] == 502 and "gpu0-eagle" in error["message"]
    # Nothing is retried after the first byte: the baseline never saw the request.
    assert group.state("baseline")["requests"] == 0
    stream = client(group).chat.completions.create(
        model="m", messages=PROMPT, max_tokens=50, stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError, match="backend"):
        for _ in stream:
            pass


def test_stalled_backend_hits_the_first_byte_timeout(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    g = routed_group(router_env={"SPECROUTER_TIMEOUTS__FIRST_BYTE": "0.5",
                                 "SPECROUTER_RETRY__ENABLED": "false"})
    g.control("eagle", stall=True)
    started = time.monotonic()
    answer = loopback.post(f"{g.router.url}/v1/chat/completions", timeout=30.0, json={
        "model": "m", "messages": PROMPT, "max_tokens": 5, "stream": True})
    assert answer.status_code == 504 and "timed out" in answer.json()["error"]["message"]
    assert time.monotonic() - started < 5
    g.router.wait_idle()


def test_backend_api_key_replaces_the_clients(routed_group: Callable[..., RoutedGroup]) -> None:
    g = routed_group(sim_args=("--api-key", "engine-secret"), router_api_key="engine-secret")
    reply = client(g).chat.completions.create(model="m", messages=PROMPT, max_tokens=4)
    assert reply.choices[0].message.content
    assert "engine-secret" not in g.router.process.output()
    g.router.wait_idle()


def test_client_authorization_is_forwarded(routed_group: Callable[..., RoutedGroup]) -> None:
    g = routed_group(sim_args=("--api-key", "engine-secret"))
    with pytest.raises(openai.AuthenticationError):
        client(g).chat.completions.create(model="m", messages=PROMPT, max_tokens=4)
    good = openai.OpenAI(base_url=g.router.v1, api_key="engine-secret", max_retries=0)
    assert good.chat.completions.create(model="m", messages=PROMPT, max_tokens=4)
    g.router.wait_idle()


def test_non_stream_client_gone_aborts_upstream(
    routed_group: Callable[..., RoutedGroup],
) -> None:
    """A client that gives up on a non-streaming request frees the engine slot too."""
    g = routed_group(time_scale=0.5)
    body = {"model": "m", "messages": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        loopback.post(f"{g.router.url}/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while g.state("eagle")["aborted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.state("eagle")["aborted"] == 1 and g.state("eagle")["finished"] == 0
    g.router.wait_idle()
