"""Descriptor exhaustion: a router under `ulimit -n 256` with 400 idle client sockets.

Without a budget the idle sockets take every descriptor: the router's own health checks
fail with ConnectError, both backends are marked down, a client on an open keep-alive
connection gets `503 no_backend`, and new clients hang in the listen backlog. With it, the
router serves fewer connections than its lowered limit, keeps descriptors in reserve for
health checks and upstream connections, and answers the connections beyond the budget
with the OpenAI-format 503.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx

from loadtest import loopback
from tests.drills.conftest import FAST_BREAKER, FAST_HEALTH, chat_body
from tests.fixtures.procs import ManagedProcess, free_port, specrouter_argv, wait_until
from tests.fixtures.sim import SimGroup

NOFILE = 256
IDLE_SOCKETS = 400


def _start_router(process_factory: list[ManagedProcess],
                  sims: SimGroup) -> tuple[str, ManagedProcess]:
    port = free_port()
    backends = [{"name": f"gpu0-{pool}", "url": sims.url(pool), "pool": pool, "group": "gpu0"}
                for pool in ("eagle", "baseline")]
    env = {
        "SPECROUTER_BACKENDS": json.dumps(backends),
        "SPECROUTER_HEALTH": json.dumps(FAST_HEALTH),
        "SPECROUTER_BREAKER": json.dumps(FAST_BREAKER),
        # Idle sockets stay open for the whole drill: the head and keep-alive timeouts
        # would otherwise free their descriptors.
        "SPECROUTER_LIMITS": json.dumps({"header_timeout_s": 60, "keep_alive_timeout_s": 60}),
    }
    argv = ["prlimit", f"--nofile={NOFILE}:{NOFILE}",
            *specrouter_argv("serve", "--host", "127.0.0.1", "--port", str(port))]
    proc = ManagedProcess(argv, env=env).start()
    process_factory.append(proc)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health", timeout=30.0)
    return url, proc


def _all_healthy(client: httpx.Client, url: str) -> bool:
    ready = client.get(f"{url}/ready").json()
    return all(b["healthy"] for b in ready["backends"])


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _open_idle(port: int, count: int) -> list[Connection]:
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


async def _answer_or_silence(reader: asyncio.StreamReader, wait_s: float) -> bytes | None:
    try:
        return await asyncio.wait_for(reader.read(), wait_s)
    except TimeoutError:
        return None


def _router_fds(proc: ManagedProcess) -> int:
    assert proc.proc is not None
    return len(os.listdir(f"/proc/{proc.proc.pid}/fd"))


def test_idle_sockets_beyond_the_descriptor_budget_get_503_backends_stay_healthy(
        sim_group: object, process_factory: list[ManagedProcess]) -> None:
    sims = sim_group(time_scale=0.05)  # type: ignore[operator]
    url, proc = _start_router(process_factory, sims)
    port = int(url.rsplit(":", 1)[1])
    budget = re.search(r"descriptors: limit (\d+); (\d+) client connections", proc.output())
    assert budget is not None, proc.output()[-2000:]
    assert int(budget.group(1)) == NOFILE
    max_connections = int(budget.group(2))
    assert 8 <= max_connections < NOFILE // 2, budget.group(0)
    assert "lowered from 4096 client connections" in proc.output()

    # One keep-alive connection, opened before the flood.
    keep_alive = loopback.client(timeout=10.0, limits=httpx.Limits(max_connections=1))
    wait_until(lambda: _all_healthy(keep_alive, url), 20.0, "both backends healthy")
    body = chat_body(max_tokens=4, stream=False)

    async def flood() -> tuple[list[bytes], int]:
        sockets = await _open_idle(port, IDLE_SOCKETS)
        try:
            answers = await asyncio.gather(*(_answer_or_silence(r, 3.0) for r, _ in sockets))
            refused = [a for a in answers if a is not None]
            served = len(answers) - len(refused)
            # While the idle sockets hold their descriptors: the router is below its limit,
            # its health checks pass, the keep-alive client is served, a new one gets 503.
            assert _router_fds(proc) < NOFILE
            for _ in range(10):  # ten health-check intervals at least
                assert _all_healthy(keep_alive, url), keep_alive.get(f"{url}/ready").text
                await asyncio.sleep(FAST_HEALTH["interval_s"])
            answer = keep_alive.post(f"{url}/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"]
            fresh = loopback.post(f"{url}/v1/chat/completions", json=body, timeout=10.0)
            assert fresh.status_code == 503, fresh.text
            assert fresh.json()["error"]["code"] == "overloaded"
            return refused, served
        finally:
            for _, writer in sockets:
                writer.close()

    refused, served = asyncio.run(flood())
    assert served <= max_connections - 2, (served, max_connections)  # the keep-alive one too
    assert len(refused) + served == IDLE_SOCKETS
    for raw in refused:
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), raw[:200]
        assert json.loads(payload)["error"]["code"] == "overloaded"

    # The idle sockets closed: new clients are served again.
    wait_until(lambda: loopback.post(f"{url}/v1/chat/completions", json=body,
                                  timeout=10.0).status_code == 200, 10.0, "a new client served")
    keep_alive.close()
    assert proc.proc is not None and proc.proc.poll() is None
    assert "Too many open files" not in proc.output()
