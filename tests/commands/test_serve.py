"""`specrouter serve` at start-up: warnings an operator must see, secrets never shown."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.procs import ManagedProcess, free_port, specrouter_argv

BACKENDS = [{"name": "e", "url": "http://127.0.0.1:9", "pool": "eagle", "group": "g"},
            {"name": "b", "url": "http://127.0.0.1:10", "pool": "baseline", "group": "g"}]


def _started(process_factory: list[ManagedProcess], redis_url: str) -> str:
    port = free_port()
    proc = ManagedProcess(specrouter_argv("serve", "--host", "127.0.0.1", "--port", str(port)),
                          env={"SPECROUTER_BACKENDS": json.dumps(BACKENDS),
                               "SPECROUTER_REDIS_URL": redis_url}).start()
    process_factory.append(proc)
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=30.0)
    return proc.output()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis://acluser@127.0.0.1:1/0",
                                 "rediss://127.0.0.1:1/0"])
def test_a_redis_url_without_a_password_is_warned_about(
        process_factory: list[ManagedProcess], url: str) -> None:
    output = _started(process_factory, url)
    assert "WARNING" in output and f"the Redis URL {url} has no password" in output


def test_a_redis_url_with_a_password_is_not_warned_about_nor_shown(
        process_factory: list[ManagedProcess]) -> None:
    output = _started(process_factory, "redis://acluser:s3cr3t-pw@127.0.0.1:1/0")
    assert "has no password" not in output
    assert "s3cr3t-pw" not in output and "redis://acluser:***@127.0.0.1:1/0" in output
