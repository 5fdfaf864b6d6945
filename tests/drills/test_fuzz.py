"""Property-based fuzzing of the router's HTTP API over real HTTP (hypothesis).

Random JSON bodies (and random bytes), random headers, methods and paths, against one
router in front of one simulated group. The properties: the router answers every request
(no hang, streams end), never with a 5xx of its own making (500) - only 502/503/504 that
name an upstream problem - every error body is JSON, and once the fuzzing is over nothing
is left in flight. Generations are capped at a few tokens so an example stays short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loadtest import loopback
from tests.drills.conftest import assert_alive, assert_idle
from tests.fixtures.router import RoutedGroup, group_backends, start_router, start_sim_group

PATHS = ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/policy",
         "/ready", "/health", "/metrics", "/model_info", "/server_info", "/v1/embeddings",
         "/v1/unknown/thing", "/nope", "/v1/chat/completions/extra"]
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
ALLOWED_5XX = {502, 503, 504}

json_scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                           max_leaves=12)
known_fields = st.fixed_dictionaries({}, optional={
    "model": json_values, "stream": st.booleans() | json_values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(max_size=30)}),
                         max_size=2) | json_values,
    "prompt": st.text(max_size=30) | json_values, "text": st.text(max_size=30),
    "stream_options": json_values, "temperature": json_values, "stop": json_values,
})
bodies = (st.builds(lambda known, extra: {**extra, **known}, known_fields,
                    st.dictionaries(st.text(max_size=12), json_values, max_size=3))
          | json_values | st.binary(max_size=64))
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126),
                        max_size=40).map(str.strip)  # the client refuses padded values
headers = st.dictionaries(
    st.sampled_from(["x-request-id", "x-specrouter-pool", "authorization", "content-type",
                     "accept", "x-custom", "user-agent"]), header_values, max_size=4)


def _capped(body: Any) -> Any:
    """Keep generations to a few tokens: a valid long one is not a hang, just slow."""
    if isinstance(body, dict):
        body = {**body, "max_tokens": 3, "max_completion_tokens": 3,
                "sampling_params": {"max_new_tokens": 3}}
    return body


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[RoutedGroup]:
    started: list[Any] = []
    try:
        sim, eagle, baseline = start_sim_group(started, time_scale=0.02)
        proc = start_router(started, group_backends(eagle, baseline),
                            env={"SPECROUTER_ADMIN_TOKEN": "fuzz-admin-token-41d7"})
        yield RoutedGroup(router=proc, eagle_url=eagle, baseline_url=baseline, sim=sim)
    finally:
        for p in reversed(started):
            p.stop()


def _check(response: httpx.Response, body_text: bytes) -> None:
    assert response.status_code < 500 or response.status_code in ALLOWED_5XX, \
        (response.status_code, body_text[:300])
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        json.loads(body_text)  # every JSON answer, error or not, parses
    else:
        # The router's own errors are JSON; an engine's answer passes through as it is.
        assert response.status_code < 400 or "x-specrouter-backend" in response.headers, \
            (response.status_code, body_text[:300])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(method=st.sampled_from(METHODS), path=st.sampled_from(PATHS) | st.text(
    st.characters(min_codepoint=33, max_codepoint=126), max_size=30).map(lambda p: "/" + p),
    body=bodies, extra_headers=headers)
@example(method="GET", path="//::", body=b"", extra_headers={})  # "//" starts the path
def test_random_requests_never_crash_or_hang(fuzzed: RoutedGroup, method: str, path: str,
                                             body: Any, extra_headers: dict[str, str]) -> None:
    if path == "/policy" and method in ("PUT", "PATCH"):
        extra_headers = {**extra_headers, "authorization": "Bearer wrong"}
    content = body if isinstance(body, bytes) else json.dumps(_capped(body)).encode()
    # The router's URL and the path as one string: httpx reads a relative "//host..." as
    # another authority (a path like "//::" then fails in the client, never reaching the
    # router), where the joined URL keeps it as the request's path.
    with loopback.client(timeout=20.0) as http, \
            http.stream(method, fuzzed.router.url + path, content=content,
                        headers=extra_headers) as response:
        received = b"".join(response.iter_bytes())  # the stream must end
        _check(response, received)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert received.rstrip().endswith(b"data: [DONE]"), received[-200:]


def test_after_fuzzing_nothing_is_left_in_flight(fuzzed: RoutedGroup) -> None:
    assert_alive(fuzzed.router)
    assert_idle(fuzzed.router)
    assert "Traceback" not in fuzzed.router.process.output()
