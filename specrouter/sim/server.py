"""Run a GPU group's simulated engines: one process, one event loop, one simulated GPU,
one uvicorn server per engine port.

uvicorn's own signal capture assumes one server per process, so it is switched off and this
module turns SIGTERM/SIGINT into a shutdown of every server at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Generator
from dataclasses import dataclass

import uvicorn

from specrouter.sim.api import ServerSettings, SimServer, build_app
from specrouter.sim.engine import Engine
from specrouter.sim.faults import Faults
from specrouter.sim.gpu import SharedGpu, SimClock
from specrouter.sim.profile import EngineDefaults, Profile, engine_limits
from specrouter.sim.version import V0_5_23, SglangVersion

#: How long SGLang's server keeps an idle keep-alive connection open: uvicorn's
#: `timeout_keep_alive`, `SGLANG_TIMEOUT_KEEP_ALIVE` (default 5 in 0.5.23 and 0.5.10;
#: srt/environ.py:337, srt/entrypoints/http_server.py:2999). Like SGLang, the servers run
#: on uvloop (`cli.py`), whose libuv accepts one connection per turn of the loop.
SGLANG_KEEP_ALIVE_S = 5


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Listener:
    """Closes and reopens one server's listening socket (the refuse_connections fault):
    a closed socket makes connects fail with ECONNREFUSED, as a dead server's port does."""

    def __init__(self, server: _Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.refusing = False
        self._reopen: asyncio.TimerHandle | None = None

    async def set_refusing(self, refuse: bool, for_s: float | None = None,
                           faults: Faults | None = None) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if refuse and for_s is not None:
            loop = asyncio.get_running_loop()
            self._reopen = loop.call_later(for_s, lambda: loop.create_task(
                self._reopen_later(faults)))
        if refuse == self.refusing:
            return
        self.refusing = refuse
        if refuse:
            for srv in self.server.servers:
                srv.close()
            return
        await self._listen()

    async def _reopen_later(self, faults: Faults | None) -> None:
        self._reopen = None
        if faults is not None:
            faults.refuse_connections, faults.refuse_for_s = False, None
        await self.set_refusing(False)

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        config, state = self.server.config, self.server.server_state
        lifespan_state = self.server.lifespan.state

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state=lifespan_state)

        loop = asyncio.get_running_loop()
        self.server.servers = [await loop.create_server(protocol, sock=sock,
                                                        backlog=config.backlog)]


async def _serve(server: _Server) -> None:
    """uvicorn exits the process (SystemExit) when it cannot bind; turn that into an error
    this module can report, so the sibling server shuts down cleanly too."""
    try:
        await server.serve()
    except SystemExit as exc:
        raise OSError(f"port {server.config.port}: could not start (exit {exc.code})") from None


@dataclass(frozen=True)
class EngineSpec:
    kind: str  # "eagle" | "baseline" | "adaptive"
    port: int



async def serve_group(profile: Profile, specs: list[EngineSpec], *, host: str, group: str,
                      time_scale: float, seed: int, api_key: str | None,
                      served_model_name: str | None,
                      max_queued_requests: int | None = None,
                      max_running_requests: int | None = None,
                      version: SglangVersion = V0_5_23,
                      priority_scheduling: bool = False,
                      enable_cache_report: bool = False,
                      max_total_tokens: dict[str, int] | None = None) -> None:
    """`max_total_tokens` maps an engine kind to its KV pool in tokens (SGLang's
    --max-total-tokens), replacing the profile's kv_capacity_tokens."""
    clock = SimClock(time_scale)
    gpu = SharedGpu(clock)
    servers: list[_Server] = []
    engines: list[Engine] = []
    group_servers: dict[str, SimServer] = {}
    for spec in specs:
        limits = engine_limits(profile, spec.kind)
        if max_running_requests is not None:
            limits = EngineDefaults(max_running_requests, limits.kv_capacity_tokens)
        if max_total_tokens and spec.kind in max_total_tokens:
            limits = EngineDefaults(limits.max_running_requests, max_total_tokens[spec.kind])
        engine = Engine(f"{group}-{spec.kind}", spec.kind, profile, gpu, seed, limits,
                        max_queued_requests)
        engine.decode_log_clears_hit_rate = version.decode_log_clears_hit_rate
        settings = ServerSettings(host, spec.port, served_model_name or profile.served_model_name,
                                  api_key, seed, group, version, priority_scheduling,
                                  enable_cache_report)
        sim = SimServer(engine, settings, group_servers=group_servers)
        group_servers[spec.kind] = sim
        config = uvicorn.Config(build_app(sim), host=host, port=spec.port, loop="none",
                                http="httptools", lifespan="off", log_level="warning",
                                access_log=False, timeout_graceful_shutdown=1,
                                timeout_keep_alive=SGLANG_KEEP_ALIVE_S, backlog=4096)
        server = _Server(config)
        sim.listener = Listener(server, host, spec.port)
        servers.append(server)
        engines.append(engine)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for srv in servers:
            srv.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    for engine in engines:
        engine.start()
    tasks = [asyncio.ensure_future(_serve(srv)) for srv in servers]
    while not all(srv.started for srv in servers):
        if any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    failed = [t for t in tasks if t.done()]
    if failed:
        stop()
        for engine in engines:
            await engine.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise OSError("could not listen on every port (see the error above)")
    if all(srv.started for srv in servers):
        ports = " ".join(f"{s.kind}=http://{host}:{s.port}" for s in specs)
        print(f"specrouter sim ready: group={group} sglang={version.name} profile={profile.name} "
              f"time_scale={time_scale} seed={seed} {ports}", flush=True)
    try:
        await asyncio.gather(*tasks)
    finally:
        stop()
        for engine in engines:
            await engine.stop()
        sys.stdout.flush()
