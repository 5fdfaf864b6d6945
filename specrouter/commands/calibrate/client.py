"""The calibration load client: closed-loop streaming chat requests against one server.

A small httpx loop of its own: the product does not depend on the load-test package.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import httpx

from specrouter.commands.calibrate.measure import LevelResult, SweepFacts
from specrouter.observe.loadview import EngineSample
from specrouter.observe.telemetry import (
    TelemetryParseError,
    parse_metrics,
    parse_server_info_accept,
    parse_v1_loads,
)

T = TypeVar("T")
_WORDS = ("alpha", "delta", "gamma", "kappa", "omega", "sigma", "theta", "lambda")


@dataclass(frozen=True)
class LoadShape:
    input_tokens: int = 1000
    output_tokens: int = 256
    model: str | None = None


class PoolClient:
    """Streams chat completions from one server and times them."""

    def __init__(self, base_url: str, shape: LoadShape, api_key: str | None,
                 client: httpx.AsyncClient) -> None:
        self._url = base_url.rstrip("/") + "/v1/chat/completions"
        self._shape = shape
        self._headers = _auth(api_key)
        self._client = client
        self._prompt = _prompt(shape.input_tokens)
        self._nonce = secrets.token_hex(6)
        self._sent = 0

    async def one(self, result: LevelResult) -> None:
        """One request, recorded into `result` (an error only counts)."""
        self._sent += 1
        body: dict[str, Any] = {
            "model": self._shape.model or "default",
            "messages": [{"role": "user", "content": f"{self._nonce}-{self._sent} {self._prompt}"}],
            "max_tokens": self._shape.output_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        ttft: float | None = None
        tokens = chunks = 0
        try:
            async with self._client.stream("POST", self._url, json=body,
                                           headers=self._headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    result.errors += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.errors += 1
                        return
                    usage = event.get("usage")
                    if isinstance(usage, dict) and usage.get("completion_tokens"):
                        tokens = int(usage["completion_tokens"])
                    for choice in event.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            chunks += 1
                            if ttft is None:
                                ttft = time.perf_counter() - started
        except (httpx.HTTPError, ValueError):
            result.errors += 1
            return
        ended = time.perf_counter()
        result.requests += 1
        result.output_tokens += tokens or chunks
        result.latencies_s.append(ended - started)
        result.spans.append((started + (ttft or 0.0), ended, tokens or chunks))
        if ttft is not None:
            result.ttfts_s.append(ttft)


def _prompt(tokens: int) -> str:
    """About 4 characters a token for English-like text, as SGLang's tokenizers (and the
    simulator) count it. Each request puts a tag of its own in front (`PoolClient.one`), so
    SGLang's radix cache holds no prefix of it and every request pays its whole prefill, as
    the traffic being calibrated for does: a repeated prompt would be prefilled once and then
    served from cache, and the sweep would measure decode alone."""
    words = [_WORDS[i % len(_WORDS)] for i in range(max(1, tokens * 4 // 6))]
    return " ".join(words)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def run_level(pool_client: PoolClient, pool: str, concurrency: int,
                    duration_s: float | None, requests: int | None) -> LevelResult:
    """C workers back to back until `duration_s` is over (or `requests` were started)."""
    result = LevelResult(pool, concurrency)
    started = time.perf_counter()
    deadline = None if duration_s is None else started + duration_s
    if deadline is not None:
        result.window = (started, deadline)
    budget = [requests if requests is not None else 0]

    async def worker() -> None:
        while True:
            if deadline is not None and time.perf_counter() >= deadline:
                return
            if requests is not None:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
            await pool_client.one(result)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result


async def served_model(base_url: str, api_key: str | None, client: httpx.AsyncClient) -> str:
    """The model id the server serves (SGLang answers requests for other names too, but
    a stricter server might not)."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=_auth(api_key))
        model = resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"
    return model if isinstance(model, str) else "default"


async def _read_engine_fact(
    base_url: str, client: httpx.AsyncClient, include: str,
    from_loads: Callable[[EngineSample], T | None], from_server_info: Callable[[Any], T | None],
) -> T | None:
    """A fact from the live `/v1/loads`, else from `/server_info` (older SGLang, or a
    server that leaves it out of loads); best effort: None when neither says."""
    base = base_url.rstrip("/")
    try:
        resp = await client.get(f"{base}/v1/loads?include={include}", timeout=5.0)
        if resp.status_code == 200:
            value = from_loads(parse_v1_loads(resp.json(), 0.0))
            if value is not None:
                return value
        resp = await client.get(f"{base}/server_info", timeout=5.0)
        if resp.status_code == 200:
            return from_server_info(resp.json())
    except (httpx.HTTPError, ValueError, TelemetryParseError):
        return None
    return None


async def read_accept_length(base_url: str, client: httpx.AsyncClient) -> float | None:
    """The EAGLE server's accept length over its last 40 decode batches (SGLang's /metrics
    gauge, with --enable-metrics): the workload of the level just run. Without /metrics,
    the lifetime mean of /v1/loads or /server_info, which also counts every earlier
    request of the server (best effort: None when nothing says)."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=5.0)
        if resp.status_code == 200:
            windowed = parse_metrics(resp.text, 0.0).accept_length
            if windowed is not None:
                return windowed
    except (httpx.HTTPError, TelemetryParseError):
        pass
    return await _read_engine_fact(base_url, client, "core,spec",
                                   lambda sample: sample.accept_lifetime, parse_server_info_accept)


async def read_max_running(base_url: str, client: httpx.AsyncClient) -> int | None:
    """The server's max running requests (its largest decode batch), if it says."""
    return await _read_engine_fact(base_url, client, "core",
                                   lambda sample: sample.max_running or None,
                                   _server_info_max_running)


def _server_info_max_running(info: Any) -> int | None:
    value = info.get("max_running_requests") if isinstance(info, dict) else None
    return value if isinstance(value, int) and value > 0 else None


async def sweep(
    urls: Mapping[str, str], levels: Sequence[int], shape: LoadShape, api_key: str | None,
    duration_s: float | None, requests: int | None,
    on_level: Callable[[LevelResult], None] | None = None,
) -> tuple[dict[str, list[LevelResult]], SweepFacts]:
    """Both pools, one after the other (the servers share the GPU, so the one not being
    measured sits idle); returns the results and what the servers said. `on_level` sees
    each level as it ends."""
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels))
    timeout = httpx.Timeout(600.0, connect=10.0)
    results: dict[str, list[LevelResult]] = {}
    facts = SweepFacts()
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        if shape.model is None:
            shape = replace(shape, model=await served_model(urls["eagle"], api_key, client))
        for pool, url in urls.items():
            facts.max_running[pool] = await read_max_running(url, client)
            pool_client = PoolClient(url, shape, api_key, client)
            await pool_client.one(LevelResult(pool, 1))  # warm-up, not counted
            results[pool] = []
            for level in levels:
                result = await run_level(pool_client, pool, level, duration_s, requests)
                results[pool].append(result)
                if pool == "eagle":  # the window of the last steps: this level's workload
                    facts.accept_by_level[level] = await read_accept_length(url, client)
                if on_level is not None:
                    on_level(result)
    return results, facts


async def apply_policy(router_url: str, token: str, patch: Mapping[str, Any]) -> dict[str, Any]:
    """PATCH `patch` into a running router's `/policy`; its answer."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        resp = await client.patch(router_url.rstrip("/") + "/policy", json=dict(patch),
                                  headers=_auth(token))
    if resp.status_code != 200:
        raise RuntimeError(f"PATCH /policy answered {resp.status_code}: {resp.text[:500]}")
    data: dict[str, Any] = resp.json()
    return data
