"""`specrouter serve --workers 2`: two uvicorn worker processes behind one port, sharing the
policy through Redis; without Redis the command is refused with a clear message."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import openai

from loadtest import loopback
from tests.cluster.conftest import ADMIN_TOKEN, MODEL
from tests.fixtures.procs import specrouter_argv, wait_until
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory
from tests.fixtures.sim import SimGroup


def _backends(group: SimGroup) -> list[dict[str, Any]]:
    return [{"name": f"gpu0-{pool}", "url": group.url(pool), "pool": pool, "group": "gpu0"}
            for pool in ("eagle", "baseline")]


def test_two_workers_share_the_policy_through_redis(
    redis_server: RedisServer, sim_group: Any, router: RouterFactory
) -> None:
    group = sim_group(time_scale=0.05)
    proc = router(_backends(group), extra_args=("--workers", "2"),
                  env={"SPECROUTER_REDIS_URL": redis_server.url(),
                       "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
    seen: dict[str, int] = {}  # replica id -> policy version it last answered

    def poll() -> None:
        # A fresh connection each time: the kernel hands it to either worker.
        view = loopback.get(f"{proc.url}/policy", timeout=5.0).json()
        seen[view["state"]["replica_id"]] = view["policy"]["version"]

    def both_workers_answered() -> bool:
        poll()
        return len(seen) == 2

    wait_until(both_workers_answered, 30.0, "both workers answering")
    assert set(seen.values()) == {1}
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0)
    for _ in range(4):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        assert reply.choices[0].message.content

    answer = loopback.patch(f"{proc.url}/policy", json={"switch_up": 33}, timeout=10.0,
                         headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert answer.status_code == 200, answer.text

    def both_on_version_2() -> bool:
        poll()
        return set(seen.values()) == {2}

    wait_until(both_on_version_2, 10.0, f"both workers on version 2 (now {seen})")
    stored = json.loads(redis_server.client().hget("specrouter:policy", "doc") or "{}")
    assert stored["switch_up"] == 33


def test_workers_without_redis_are_refused() -> None:
    backends = json.dumps([{"name": "e", "url": "http://127.0.0.1:9", "pool": "eagle",
                            "group": "gpu0"}])
    done = subprocess.run(specrouter_argv("serve", "--workers", "2"), capture_output=True,
                          text=True, timeout=60,
                          env={**_clean_env(), "SPECROUTER_BACKENDS": backends})
    assert done.returncode != 0
    assert "2 workers need shared state" in done.stderr
    assert "SPECROUTER_REDIS_URL" in done.stderr


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTER_")}


def test_redis_password_never_shown(
    redis_factory: Any, sim_group: Any, router: RouterFactory
) -> None:
    password = "s3cret-Pa55-for-redis"
    server = redis_factory(password=password, user="specrouter")
    group = sim_group(time_scale=0.05)
    proc = router(_backends(group), extra_args=("--workers", "2", "--log-level", "debug"),
                  env={"SPECROUTER_REDIS_URL": server.url()})
    wait_until(lambda: loopback.get(f"{proc.url}/ready", timeout=5.0).json()["state"]["connected"],
               20.0, "connected to the password-protected redis")
    shown = [loopback.get(f"{proc.url}{path}", timeout=5.0).text
             for path in ("/ready", "/policy", "/metrics")]
    assert "specrouter:***@127.0.0.1" in shown[0]  # the user stays, the password does not
    server.kill()  # failures are logged too: with the redacted URL only
    wait_until(lambda: loopback.get(f"{proc.url}/ready", timeout=5.0).json()["state"]["degraded"],
               20.0, "degraded")
    shown.append(loopback.get(f"{proc.url}/ready", timeout=5.0).text)
    proc.process.stop()
    log = proc.process.output()
    assert "unreachable" in log and "specrouter:***@" in log
    for text in (*shown, log):
        assert password not in text
