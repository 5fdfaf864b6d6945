"""Health end to end: active checks, passive outcomes and breakers move traffic.

Faults come from the simulator's control endpoint: refused connections, slow health
checks (longer than the router's check timeout), and 5xx answers to generation requests.
"""

from __future__ import annotations

from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.integration.conftest import Cluster, ClusterFactory

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=30.0)


def _ask(client: openai.OpenAI) -> tuple[str, str, str]:
    """(backend, pool, reason) of one short request, which must succeed."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert raw.parse().choices[0].finish_reason == "length"
    h = raw.headers
    return h["x-specrouter-backend"], h["x-specrouter-pool"], h["x-specrouter-reason"]


def _decisions_for(client: openai.OpenAI, group: str, want: int = 3,
                   limit: int = 60) -> list[tuple[str, str, str]]:
    """Send requests until `want` of them were routed to `group` (the group choice breaks
    ties between the idle groups at random)."""
    seen: list[tuple[str, str, str]] = []
    for _ in range(limit):
        routed = _ask(client)
        if routed[0].startswith(group + "-"):
            seen.append(routed)
            if len(seen) == want:
                return seen
    raise AssertionError(f"only {len(seen)} of {limit} requests went to {group}")


def test_unhealthy_eagle_sends_its_group_to_the_baseline_and_back(
    cluster: ClusterFactory,
) -> None:
    c = cluster()
    client = _client(c)
    c.sim("gpu0").control("eagle", refuse_connections=True)
    c.wait_backend("gpu0-eagle", "unhealthy", lambda b: not b["healthy"])
    for backend, pool, reason in _decisions_for(client, "gpu0"):
        assert (backend, pool, reason) == ("gpu0-baseline", "baseline", "eagle_unhealthy")
    # The other group is untouched.
    assert c.backend("gpu1-eagle")["healthy"]
    c.sim("gpu0").control("eagle", refuse_connections=False)  # sent via the sibling
    c.wait_backend("gpu0-eagle", "healthy again", lambda b: b["healthy"])
    assert _decisions_for(client, "gpu0", want=1)[0][1] == "eagle"


def test_slow_health_checks_on_the_baseline_send_its_group_to_eagle(
    cluster: ClusterFactory,
) -> None:
    c = cluster(policy={"mode": "baseline"})
    client = _client(c)
    # Longer than the router's health timeouts in these tests (/ready 0.5 s, /health 2 s).
    c.sim("gpu1").control("baseline", slow_health_ms=3000)
    info = c.wait_backend("gpu1-baseline", "unhealthy", lambda b: not b["healthy"], 20.0)
    assert "no answer" in (info["last_error"] or "")
    for backend, pool, reason in _decisions_for(client, "gpu1"):
        assert (backend, pool, reason) == ("gpu1-eagle", "eagle", "baseline_unhealthy")
    assert _decisions_for(client, "gpu0", want=1)[0][1:] == ("baseline", "forced_mode")


def test_group_with_no_healthy_server_is_skipped(cluster: ClusterFactory) -> None:
    c = cluster()
    client = _client(c)
    gpu0 = c.sim("gpu0")
    gpu0.control("eagle", refuse_connections=True)  # sent through the baseline's port
    # The baseline closes its own port last; it reopens by itself after 60 s.
    loopback.post(f"{gpu0.baseline_url}/sim/control", json={"refuse_connections": 60},
               timeout=5.0).raise_for_status()
    for name in ("gpu0-eagle", "gpu0-baseline"):
        c.wait_backend(name, "unhealthy", lambda b: not b["healthy"])
    routed = [_ask(client) for _ in range(10)]
    assert {backend for backend, _, _ in routed} == {"gpu1-eagle"}
    assert c.policy()["groups"][0]["reason"] == "no_healthy_server"


def test_breaker_opens_on_5xx_and_closes_through_half_open_probes(
    cluster: ClusterFactory,
) -> None:
    c = cluster()
    client = _client(c)
    # Health checks stay green: only real requests fail, so only the breaker can notice.
    c.sim("gpu0").control("eagle", error_rate=1.0, error_status=503)
    for _ in range(60):
        _ask(client)  # a 503 before the first byte is retried elsewhere: no client error
        if c.backend("gpu0-eagle")["breaker"] == "open":
            break
    opened = c.backend("gpu0-eagle")
    assert opened["breaker"] == "open" and not opened["healthy"]
    for backend, _, reason in _decisions_for(client, "gpu0", want=2):
        assert (backend, reason) == ("gpu0-baseline", "eagle_unhealthy")
    c.sim("gpu0").control("eagle", error_rate=0.0)
    # After the cool-down one probe request at a time is let through ...
    c.wait_backend("gpu0-eagle", "half-open", lambda b: b["breaker"] == "half_open", 10.0)
    # ... and two successes close the breaker.
    wait_until(lambda: _ask(client) and c.backend("gpu0-eagle")["breaker"] == "closed",
               20.0, "the breaker to close after successful probes")
    assert c.backend("gpu0-eagle")["healthy"]
    families = {f.name: f for f in text_string_to_metric_families(
        loopback.get(f"{c.url}/metrics", timeout=5.0).text)}
    errors = _samples(families, "specrouter_upstream_errors", backend="gpu0-eagle")
    assert errors and errors[0] >= 3


def _samples(families: dict[str, Any], name: str, **labels: str) -> list[float]:
    family = families[name]
    return [s.value for s in family.samples
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())]
