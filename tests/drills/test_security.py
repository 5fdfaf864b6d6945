"""Security drills: secrets never leave the process (logs, errors, /ready, /policy,
/metrics), the upstream is only ever a configured backend, the admin token is compared in
constant time, and the abuse limits have safe defaults."""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import Callable

from loadtest import loopback
from specrouter.commands.serve import uvicorn_options
from specrouter.config import load_settings
from specrouter.control.admin import AdminApi
from tests.drills.conftest import (
    FAST_HEALTH,
    assert_alive,
    assert_idle,
    chat_body,
    run_load,
)
from tests.drills.wiretap import Wiretap
from tests.fixtures.procs import wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory
from tests.fixtures.sim import SimGroup

ADMIN = "adm1n-T0ken-zq7Xw"
BACKEND_KEY = "sk-backend-K3y-p9Lm"
REDIS_PASSWORD = "r3dis-Pa55-hq2V"


def test_no_secret_in_logs_errors_ready_policy_or_metrics(
    sim_group: Callable[..., SimGroup], router: RouterFactory,
    redis_factory: Callable[..., RedisServer],
) -> None:
    redis = redis_factory(password=REDIS_PASSWORD)
    sim = sim_group(api_key=BACKEND_KEY)
    backends = [{"name": f"gpu0-{p}", "url": sim.url(p), "pool": p, "group": "gpu0",
                 "api_key": BACKEND_KEY} for p in ("eagle", "baseline")]
    r = router(backends, env={
        "SPECROUTER_ADMIN_TOKEN": ADMIN, "SPECROUTER_REDIS_URL": redis.url(),
        "SPECROUTER_HEALTH": json.dumps(FAST_HEALTH),
        "SPECROUTER_LISTEN__LOG_LEVEL": "debug", "SPECROUTER_LISTEN__ACCESS_LOG": "true",
    })
    wait_until(lambda: r.ready().get("state", {}).get("connected"), 20.0, "redis connected")
    seen: list[str] = []
    ok = asyncio.run(run_load(r.url, 4, 2, chat_body(4)))
    assert all(o.ok for o in ok), ok  # the backend key was sent: the engine let us in
    # Failures that get logged: wrong admin tokens, a broken stream, a refused backend.
    for token in ("nope", ADMIN[:-1]):
        seen.append(loopback.patch(f"{r.url}/policy", json={"mode": "eagle"}, timeout=5.0,
                                headers={"authorization": f"Bearer {token}"}).text)
    seen.append(loopback.patch(f"{r.url}/policy", json={"mode": "bad"}, timeout=5.0,
                            headers={"authorization": f"Bearer {ADMIN}"}).text)
    sim.control("eagle", cut_stream_after_tokens=1)
    sim.control("baseline", refuse_connections=True)
    broken = asyncio.run(run_load(r.url, 3, 1, chat_body(6)))
    assert any(not o.ok for o in broken)
    seen += [o.error or "" for o in broken]
    redis.pause()  # a hung store: its errors get logged too
    try:
        wait_until(lambda: not r.ready()["state"]["connected"], 20.0, "store degraded")
    finally:
        redis.resume()
    for path in ("/ready", "/policy", "/metrics", "/v1/models", "/nope"):
        seen.append(loopback.get(f"{r.url}{path}", timeout=5.0).text)
    assert_alive(r)
    everything = "\n".join(seen) + r.process.output()
    assert "refused policy write" in everything and "stream from" in everything
    for secret in (ADMIN, BACKEND_KEY, REDIS_PASSWORD):
        assert secret not in everything, f"secret {secret[:4]}... leaked"


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):  # `connection: close`: read to the end
            received += chunk
        return received


def test_the_upstream_never_comes_from_the_request(
    sim_group: Callable[..., SimGroup], router: RouterFactory,
) -> None:
    sim = sim_group()
    with Wiretap() as evil:
        backends = [{"name": f"gpu0-{p}", "url": sim.url(p), "pool": p, "group": "gpu0"}
                    for p in ("eagle", "baseline")]
        r = router(backends)
        body = json.dumps(chat_body(2, stream=False)).encode()
        target = f"127.0.0.1:{evil.port}".encode()
        attempts = [
            # absolute-form request target naming another host
            b"POST http://" + target + b"/v1/chat/completions HTTP/1.1\r\nhost: " + target,
            # Host header pointing elsewhere
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + target,
            # forwarding headers some proxies honour
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-forwarded-host: " + target
            + b"\r\nforwarded: host=" + target,
        ]
        for head in attempts:
            answer = _raw(r.port, head + b"\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        with loopback.client(timeout=10.0) as http:
            # a URL in the body, and paths that look like URLs
            assert http.post(f"{r.url}/v1/chat/completions",
                             json={**chat_body(2, stream=False), "url": evil.url,
                                   "base_url": evil.url}).status_code == 200
            for path in (f"/v1/http://{target.decode()}/x", f"/v1//{target.decode()}/x",
                         f"/v1/../../{target.decode()}"):
                assert http.get(f"{r.url}{path}").status_code < 500
        assert evil.requests == [], evil.requests
        assert sim.state("eagle")["requests"] + sim.state("baseline")["requests"] >= 4
        assert_idle(r)


def test_admin_token_is_compared_in_constant_time() -> None:
    source = inspect.getsource(AdminApi._authorize)
    assert "hmac.compare_digest(" in source
    assert "== self._token" not in source and "self._token ==" not in source


def test_abuse_limits_have_safe_defaults_and_reach_uvicorn() -> None:
    settings = load_settings(environ={}, overrides={"backends": [
        {"name": "e", "url": "http://127.0.0.1:1", "pool": "eagle", "group": "g"}]})
    limits = settings.limits
    assert limits.max_body_bytes == 32 * 1024 * 1024
    assert limits.max_header_bytes == 64 * 1024
    assert limits.header_timeout_s == 10.0
    assert limits.body_timeout_s == 60.0
    assert limits.max_connections == 4096
    assert settings.shutdown.drain_timeout_s == 30.0
    options = uvicorn_options(settings)
    assert options["limit_concurrency"] == 4096
    assert options["timeout_keep_alive"] == 5.0
    # the guard (head size and time) plus the connection limit enforced at accept
    assert options["http"] == "specrouter.edge.guard:BudgetedHttpToolsProtocol"
