"""Telemetry of each backend's engine: parsers of SGLang's load endpoints, and a poller.

Shapes read from SGLang sources (see docs/policy.md for the files):
- GET /v1/loads (0.5.10+): {"timestamp","version","dp_rank_count","loads":[{"dp_rank",
  "num_running_reqs","num_waiting_reqs",...,"speculative":{"accept_length","accept_rate"}}],
  "aggregate":{"total_running_reqs","total_waiting_reqs",...}} (aggregate: 0.5.10 only)
- GET /get_load (up to 0.5.10): [{"dp_rank","num_reqs","num_waiting_reqs","num_tokens"}]
  where num_reqs = running + waiting (scheduler.get_load)
- GET /metrics (--enable-metrics): gauges sglang:num_running_reqs, sglang:num_queue_reqs,
  sglang:spec_accept_length, one series per tp/pp/dp rank label set
- GET /server_info: internal_states[].avg_spec_accept_length

The parsers are pure; only `TelemetryPoller` does I/O.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specrouter.backends import Backend
from specrouter.observe.loadview import EngineSample
from specrouter.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SOURCES = ("v1_loads", "get_load", "metrics")
PATHS = {
    "v1_loads": "/v1/loads?include=core,spec",
    "get_load": "/get_load",
    "metrics": "/metrics",
}


class TelemetryParseError(ValueError):
    """The payload does not have the shape SGLang sends."""


def _int(d: dict[str, Any], key: str, where: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TelemetryParseError(f"{where}: {key!r} missing or not a number")
    return int(v)


def _accept_mean(values: list[float]) -> float | None:
    vals = [v for v in values if v > 0]
    return sum(vals) / len(vals) if vals else None


def parse_v1_loads(payload: Any, received_at: float) -> EngineSample:
    """Sum over DP ranks; accept length averaged over ranks that report one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("loads"), list):
        raise TelemetryParseError("/v1/loads: expected an object with a 'loads' list")
    running = waiting = 0
    max_running: int | None = None
    accepts: list[float] = []
    snapshots: list[tuple[float, ...] | None] = []
    for i, load in enumerate(payload["loads"]):
        if not isinstance(load, dict):
            raise TelemetryParseError(f"/v1/loads: loads[{i}] is not an object")
        running += _int(load, "num_running_reqs", f"/v1/loads loads[{i}]")
        waiting += _int(load, "num_waiting_reqs", f"/v1/loads loads[{i}]")
        snapshots.append(_snapshot_of(load))
        if isinstance(load.get("max_running_requests"), int):
            max_running = (max_running or 0) + load["max_running_requests"]
        spec = load.get("speculative")
        if isinstance(spec, dict) and isinstance(spec.get("accept_length"), int | float):
            accepts.append(float(spec["accept_length"]))
    ts = payload.get("timestamp")
    return EngineSample(running, waiting, received_at, _accept_mean(accepts), "v1_loads",
                        max_running, ts if isinstance(ts, str) else None,
                        _joined(snapshots))


#: Fields of a /v1/loads entry that SGLang freezes between two refreshes of its load
#: snapshot; the KV tokens in use move with every decode step, so a new snapshot differs.
_SNAPSHOT_FIELDS = ("num_running_reqs", "num_used_tokens", "gen_throughput")


def _snapshot_of(load: dict[str, Any]) -> tuple[float, ...] | None:
    spec = load.get("speculative")
    values = [*(load.get(k) for k in _SNAPSHOT_FIELDS),
              spec.get("accept_length") if isinstance(spec, dict) else None]
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return tuple(numbers) if len(numbers) == len(values) else None


def _joined(snapshots: list[tuple[float, ...] | None]) -> tuple[float, ...] | None:
    """One key over the DP ranks; None if a rank has none (an older server: every
    reading then counts)."""
    if not snapshots or any(s is None for s in snapshots):
        return None
    return tuple(v for s in snapshots if s is not None for v in s)


def parse_get_load(payload: Any, received_at: float) -> EngineSample:
    if not isinstance(payload, list):
        raise TelemetryParseError("/get_load: expected a list of per-rank objects")
    running = waiting = 0
    for i, load in enumerate(payload):
        if not isinstance(load, dict):
            raise TelemetryParseError(f"/get_load: item {i} is not an object")
        total = _int(load, "num_reqs", f"/get_load[{i}]")
        queued = _int(load, "num_waiting_reqs", f"/get_load[{i}]")
        running += max(0, total - queued)
        waiting += queued
    return EngineSample(running, waiting, received_at, None, "get_load")


_RANK_COPIES = ("tp_rank", "pp_rank")  # ranks of one batch: every copy shows the same count


def parse_metrics(text: str, received_at: float) -> EngineSample:
    """Prometheus text. Series that differ only in tp_rank/pp_rank describe one batch, so
    they are deduplicated (max); distinct DP ranks (or other labels) are summed."""
    per_key: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
        "sglang:num_running_reqs": {}, "sglang:num_queue_reqs": {}}
    accepts: list[float] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in per_key:
                    key = tuple(sorted((k, v) for k, v in s.labels.items()
                                       if k not in _RANK_COPIES))
                    per_key[s.name][key] = max(per_key[s.name].get(key, 0.0), s.value)
                elif s.name == "sglang:spec_accept_length":
                    accepts.append(s.value)
    except ValueError as exc:
        raise TelemetryParseError(f"/metrics: not Prometheus text ({exc})") from None
    if not per_key["sglang:num_running_reqs"]:
        raise TelemetryParseError("/metrics: no sglang:num_running_reqs gauge")
    return EngineSample(int(sum(per_key["sglang:num_running_reqs"].values())),
                        int(sum(per_key["sglang:num_queue_reqs"].values())), received_at,
                        _accept_mean(accepts), "metrics")


def parse_server_info_accept(payload: Any) -> float | None:
    """EAGLE accept length from /server_info internal_states (mean over DP ranks)."""
    if not isinstance(payload, dict):
        raise TelemetryParseError("/server_info: expected an object")
    states = payload.get("internal_states")
    if not isinstance(states, list):
        return None
    vals = [float(s["avg_spec_accept_length"]) for s in states
            if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"), int | float)]
    return _accept_mean(vals)


def parse_source(source: str, response_text: str, received_at: float) -> EngineSample:
    """Dispatch by source name (one of SOURCES)."""
    if source == "metrics":
        return parse_metrics(response_text, received_at)
    try:
        payload = json.loads(response_text)
    except json.JSONDecodeError:
        raise TelemetryParseError(f"{source}: body is not JSON") from None
    if source == "v1_loads":
        return parse_v1_loads(payload, received_at)
    if source == "get_load":
        return parse_get_load(payload, received_at)
    raise ValueError(f"unknown telemetry source {source!r}")


# --- poller -------------------------------------------------------------------------------


@dataclass
class _PollState:
    source: str | None = None  # the endpoint that answered last
    polls: int = 0


@dataclass
class TelemetryPoller:
    """Polls every backend each `interval` seconds and hands samples to `publish`.

    For each backend it tries /v1/loads, /get_load, /metrics in order and sticks to the
    first that answers with a parsable body; on a later failure it searches again.
    An EAGLE-3 backend whose source lacks the accept length gets /server_info read
    every `accept_every` polls (it is a heavier call). A failed poll publishes nothing:
    the load view then ages the last sample out (staleness) instead of trusting zeros.

    `publish(name, sample)` and `publish_accept(name, accept, received_at)` are usually
    `LoadView.publish` and `LoadView.publish_accept_length`.
    """

    backends: Sequence[Backend]
    publish: Callable[[str, EngineSample], None]
    publish_accept: Callable[[str, float, float], None] | None = None
    # called as each poll is sent (LoadView.poll_started: the credit rule needs the
    # in-flight count at the moment the engine took its snapshot)
    poll_started: Callable[[str], None] | None = None
    interval: float = 0.1
    timeout: float = 2.0
    accept_every: int = 10
    client: httpx.AsyncClient | None = None
    clock: Callable[[], float] = time.monotonic
    _states: dict[str, _PollState] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _own_client: bool = False

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError("interval must be positive")
        self._states = {b.name: _PollState() for b in self.backends}

    def source_of(self, name: str) -> str | None:
        """The endpoint that worked last for `name` (None before the first success)."""
        return self._states[name].source

    async def start(self) -> None:
        """Start one polling loop per backend (a hung one must not delay the others)."""
        if self._tasks:
            return
        if self.client is None:
            self.client, self._own_client = httpx.AsyncClient(timeout=self.timeout), True
        self._tasks = [asyncio.create_task(self._run(b), name=f"telemetry-{b.name}")
                       for b in self.backends]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._own_client and self.client is not None:
            await self.client.aclose()
            self.client, self._own_client = None, False

    async def __aenter__(self) -> TelemetryPoller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self, backend: Backend) -> None:
        while True:
            started = self.clock()
            try:
                await self.poll_once(backend)
            except Exception:  # a bug in one poll must not end telemetry for good
                log.exception("telemetry poll of %s failed", backend.name)
            await asyncio.sleep(max(0.0, self.interval - (self.clock() - started)))

    async def poll_once(self, backend: Backend) -> EngineSample | None:
        """One poll of one backend; never raises for network or payload trouble."""
        st = self._states[backend.name]
        st.polls += 1
        if self.poll_started is not None:
            self.poll_started(backend.name)
        order = [st.source] if st.source else []
        order += [s for s in SOURCES if s not in order]
        for source in order:
            sample = await self._try(backend, source)
            if sample is not None:
                st.source = source
                self.publish(backend.name, sample)
                if backend.pool == "eagle" and sample.accept_length is None:
                    await self._maybe_server_info(backend, st)
                return sample
        st.source = None
        return None

    async def _get(self, backend: Backend, path: str) -> httpx.Response:
        assert self.client is not None, "call start() or pass a client"
        headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else {}
        return await self.client.get(backend.url.rstrip("/") + path, headers=headers,
                                     timeout=self.timeout)

    async def _try(self, backend: Backend, source: str) -> EngineSample | None:
        try:
            resp = await self._get(backend, PATHS[source])
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return parse_source(source, resp.text, self.clock())
        except TelemetryParseError:
            return None

    async def _maybe_server_info(self, backend: Backend, st: _PollState) -> None:
        if self.publish_accept is None or (st.polls - 1) % self.accept_every:
            return
        for path in ("/server_info", "/get_server_info"):
            try:
                resp = await self._get(backend, path)
                if resp.status_code != 200:
                    continue
                accept = parse_server_info_accept(resp.json())
            except (httpx.HTTPError, ValueError):
                continue
            if accept is not None:
                self.publish_accept(backend.name, accept, self.clock())
            return
