"""`specrouter serve`: warnings an operator must see at start-up, secrets never shown, and
what its signal handlers hand to uvicorn's."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from specrouter.commands.serve import _DRAINS, _draining_handler
from specrouter.edge import Lifecycle
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


async def _signals_uvicorn_gets(signals: list[int]) -> list[int]:
    """What uvicorn's own handler receives when the drain's handler gets `signals`, with a
    request in progress during the first and none once they are all sent."""
    lifecycle = Lifecycle(active=1)
    told: list[int] = []
    handler = _draining_handler(asyncio.get_running_loop(), lifecycle, 30.0,
                                lambda sig, _frame: told.append(sig))
    handler(signals[0], None)
    await asyncio.sleep(0)  # the drain starts (call_soon_threadsafe)
    for sig in signals[1:]:
        handler(sig, None)
    lifecycle.active = 0
    await asyncio.gather(*_DRAINS)
    return told


@pytest.mark.parametrize(("signals", "forwarded"), [
    ([signal.SIGTERM], [signal.SIGTERM]),  # after the drain
    ([signal.SIGTERM, signal.SIGTERM], [signal.SIGTERM]),  # a repeated SIGTERM waits
    ([signal.SIGINT, signal.SIGINT], [signal.SIGINT]),  # at once, and not again
    ([signal.SIGINT, signal.SIGINT, signal.SIGINT], [signal.SIGINT, signal.SIGINT]),
], ids=["sigterm", "sigterm-twice", "ctrl-c-twice", "ctrl-c-thrice"])
def test_uvicorn_gets_a_second_ctrl_c_once_so_its_shutdown_is_not_forced(
        signals: list[int], forwarded: list[int]) -> None:
    """uvicorn takes a second SIGINT as a forced exit that skips the lifespan shutdown:
    a second Ctrl-C ends the drain, and the drain's end does not hand it over again."""
    assert asyncio.run(_signals_uvicorn_gets(signals)) == forwarded
