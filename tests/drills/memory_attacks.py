"""The memory attacks of docs/reliability.md, each against a fresh `specrouter serve` in
front of a hostile backend, with the router's peak resident memory (VmHWM) measured.

The drills (`test_memory.py`) run them small with tight limits; run at the sizes the docs
quote, with the router's default limits:

    .venv/bin/python -m tests.drills.memory_attacks

(an endless body is capped at 1 GiB and the router's total timeout set to 20 s, so that a
router without the limits cannot exhaust the machine).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import httpx

from loadtest import loopback
from tests.drills.hostile import HostileBackend, Received, Script, endless, fixed
from tests.fixtures.procs import ManagedProcess
from tests.fixtures.router import RouterProc, start_router

MIB = 1024 * 1024
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
QUIET = {"SPECROUTER_TELEMETRY__ENABLED": "false"}


def peak_rss_mib(router: RouterProc) -> float:
    """The router process's peak resident memory so far (VmHWM)."""
    proc = router.process.proc
    assert proc is not None
    with open(f"/proc/{proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@contextmanager
def routed(script: Script, env: dict[str, str] | None = None
           ) -> Iterator[tuple[RouterProc, HostileBackend]]:
    started: list[ManagedProcess] = []
    with HostileBackend(script) as backend:
        try:
            yield start_router(started, backend.backends(), {**QUIET, **(env or {})}), backend
        finally:
            for proc in started:
                proc.stop()


def held_until_the_gate_opens(holder: list[HostileBackend]) -> Script:
    def script(_: Received, out: BinaryIO) -> None:
        holder[0].gate.wait(60.0)
        out.write(OK)
    return script


def answers(cap: int | None = None) -> dict[str, Script]:
    return {
        "endless JSON body (no length)": endless(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n", cap=cap),
        "endless JSON body (chunked)": endless(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n", lambda b: b"%x\r\n%s\r\n" % (len(b), b),
            cap=cap),
        **HEADS,
    }


HEADS: dict[str, Script] = {
    "a 32 MB header": fixed(b"HTTP/1.1 200 OK\r\nx-big: " + b"h" * (32 * 1000 * 1000)
                            + b"\r\ncontent-length: 2\r\n\r\n{}"),
    "100,000 headers": fixed(b"HTTP/1.1 200 OK\r\n"
                             + b"".join(b"x-h%d: v\r\n" % i for i in range(100_000))
                             + b"content-length: 2\r\n\r\n{}"),
}


def bad_answer(router: RouterProc, timeout: float = 60.0) -> httpx.Response:
    return loopback.post(f"{router.url}/v1/chat/completions", timeout=timeout,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def _post_bodies(url: str, clients: int, size: int, done: list[httpx.Response]) -> None:
    body = b'{"model": "m", "prompt": "' + b"x" * (size - 30) + b'"}'
    async with loopback.async_client(timeout=120.0,
                                 limits=httpx.Limits(max_connections=clients)) as client:
        async def one() -> None:
            done.append(await client.post(f"{url}/v1/completions", content=body,
                                          headers={"content-type": "application/json"}))
        await asyncio.gather(*(one() for _ in range(clients)))


def large_bodies(router: RouterProc, backend: HostileBackend, clients: int, size: int,
                 opened: Callable[[list[httpx.Response]], bool]) -> list[httpx.Response]:
    """`clients` bodies of `size` bytes at once; the backend holds every request it gets
    until `opened(answers so far)` says the attack is fully under way."""
    done: list[httpx.Response] = []
    runner = threading.Thread(
        target=lambda: asyncio.run(_post_bodies(router.url, clients, size, done)))
    runner.start()
    try:
        while not opened(done):
            backend.arrived.acquire(timeout=0.2)
    finally:
        backend.gate.set()
        runner.join(120.0)
    return done


def main() -> None:
    figures: dict[str, Any] = {}
    for name, script in answers(cap=1 << 30).items():
        with routed(script, {"SPECROUTER_TIMEOUTS__TOTAL": "20"}) as (router, _):
            before = peak_rss_mib(router)
            try:
                status: int | str = bad_answer(router).status_code
            except httpx.HTTPError as exc:  # e.g. a head the client itself refuses
                status = f"relayed; the client failed: {exc}"
            figures[name] = {"status": status, "peak_rss_mib": round(peak_rss_mib(router), 1),
                             "idle_rss_mib": round(before, 1)}
    holder: list[HostileBackend] = []
    with routed(held_until_the_gate_opens(holder)) as (router, backend):
        holder.append(backend)
        before = peak_rss_mib(router)
        # the gate opens once 16 requests reached the backend or the rest were refused
        replies = large_bodies(router, backend, 16, 30 * 1000 * 1000,
                               lambda _: len(backend.received) >= 16)
        figures["16 clients x 30 MB bodies"] = {
            "statuses": sorted(r.status_code for r in replies),
            "peak_rss_mib": round(peak_rss_mib(router), 1), "idle_rss_mib": round(before, 1)}
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
