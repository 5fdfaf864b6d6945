"""`specrouter calibrate`: measure where the baseline overtakes EAGLE-3 on one GPU group.

A closed-loop concurrency sweep of each pool, directly against its server and one pool
at a time: the two servers share the GPU, so the one not being measured must sit idle.
At each level C, C workers send streaming chat requests back to back (fixed prompt and
output length, `ignore_eos`), and the level reports output throughput (the tokens
decoded before the level's deadline, while C requests were in flight) and latency.

From the two curves follow the crossover (the concurrency where the baseline's output
throughput catches up with EAGLE-3's, interpolated between levels) and the policy:

- threshold: the router decides when a request arrives, and under a closed loop of C
  clients C - 1 requests are then already in the group, so the group load that should
  switch to the baseline is `crossover - 1` (`switch_up`); `switch_down` sits a band
  below it (at least one request wide) so a load wobbling by one request does not flap;
- overflow: EAGLE-3 keeps up to floor(crossover) requests in flight (`eagle_cap`);
- goodput: the sweep is fitted into a cost model of the group (`fit_group_model`: step
  time against batch for each pool, the EAGLE curve at the accept length the server
  reported during the sweep), `--write-cost-model FILE` writes it for the router's
  `cost_model.file`, and the policy is `strategy: goodput` (the threshold band is kept
  too: a group the router has no model for falls back to it).

`--apply` PATCHes them into a running router's `/policy`; `--write-policy FILE` writes
them for `specrouter serve --policy-file FILE`.

The HTTP client is a small streaming httpx loop of its own: the product does not depend
on the load-test package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import httpx

from specrouter.observe.loadview import EngineSample
from specrouter.observe.telemetry import (
    TelemetryParseError,
    parse_server_info_accept,
    parse_v1_loads,
)
from specrouter.routing.costmodel import (
    GroupCostModel,
    SweepPoint,
    TableCurve,
    fit_group_model,
    model_to_dict,
    step_ms_from_sweep,
)

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)
T = TypeVar("T")
_WORDS = ("alpha", "delta", "gamma", "kappa", "omega", "sigma", "theta", "lambda")


@dataclass(frozen=True)
class LoadShape:
    input_tokens: int = 1000
    output_tokens: int = 256
    model: str | None = None


@dataclass
class LevelResult:
    pool: str
    concurrency: int
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list, repr=False)
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    # (first token, end, tokens) of each request, on the perf_counter clock
    spans: list[tuple[float, float, int]] = field(default_factory=list, repr=False)
    # the level's measuring window with a duration: (start, deadline)
    window: tuple[float, float] | None = None

    @property
    def throughput_tok_s(self) -> float:
        """With a duration, the tokens decoded inside [start, deadline] per second: the
        level at exactly C in flight. Counting the tail after the deadline (C falling to
        0 as the last requests end) would bias the pool whose requests end unevenly
        (EAGLE-3: accept lengths vary per request) by several %, which is the whole gap
        between the pools near the crossover."""
        if self.window is not None:
            start, end = self.window
            inside = sum(tokens * _overlap(first, last, start, end)
                         for first, last, tokens in self.spans)
            return inside / (end - start) if end > start else 0.0
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def median_latency_s(self) -> float | None:
        return statistics.median(self.latencies_s) if self.latencies_s else None

    @property
    def p90_latency_s(self) -> float | None:
        return _quantile(self.latencies_s, 0.9)

    @property
    def median_ttft_s(self) -> float | None:
        return statistics.median(self.ttfts_s) if self.ttfts_s else None

    def summary(self) -> dict[str, Any]:
        return {"pool": self.pool, "concurrency": self.concurrency, "requests": self.requests,
                "errors": self.errors, "output_tokens": self.output_tokens,
                "wall_s": round(self.wall_s, 4),
                "throughput_tok_s": round(self.throughput_tok_s, 2),
                "median_latency_s": self.median_latency_s, "p90_latency_s": self.p90_latency_s,
                "median_ttft_s": self.median_ttft_s}


def _overlap(first: float, last: float, start: float, end: float) -> float:
    """The share of a request's decode span [first, last] inside [start, end] (its tokens
    taken as evenly spread over the span)."""
    if last <= first:
        return 1.0 if start <= last <= end else 0.0
    return max(0.0, min(last, end) - max(first, start)) / (last - first)


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# --- measuring ----------------------------------------------------------------------------


class PoolClient:
    """Streams chat completions from one server and times them."""

    def __init__(self, base_url: str, shape: LoadShape, api_key: str | None,
                 client: httpx.AsyncClient) -> None:
        self._url = base_url.rstrip("/") + "/v1/chat/completions"
        self._shape = shape
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client
        self._prompt = _prompt(shape.input_tokens)

    async def one(self, result: LevelResult) -> None:
        body: dict[str, Any] = {
            "model": self._shape.model or "default",
            "messages": [{"role": "user", "content": self._prompt}],
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
    # About 4 characters a token for English-like text, as SGLang's tokenizers (and the
    # simulator) count it.
    words = [_WORDS[i % len(_WORDS)] for i in range(max(1, tokens * 4 // 6))]
    return " ".join(words)


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
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
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
    """The EAGLE server's live accept length, if it reports one (best effort)."""
    return await _read_engine_fact(base_url, client, "core,spec",
                                   lambda sample: sample.accept_length, parse_server_info_accept)


async def read_max_running(base_url: str, client: httpx.AsyncClient) -> int | None:
    """The server's max running requests (its largest decode batch), if it says."""
    return await _read_engine_fact(base_url, client, "core",
                                   lambda sample: sample.max_running or None,
                                   _server_info_max_running)


def _server_info_max_running(info: Any) -> int | None:
    value = info.get("max_running_requests") if isinstance(info, dict) else None
    return value if isinstance(value, int) and value > 0 else None


@dataclass
class SweepFacts:
    """What the servers reported during the sweep: the EAGLE accept length after each of
    its levels (None where it reported none) and each pool's max running requests."""

    accept_by_level: dict[int, float | None] = field(default_factory=dict)
    max_running: dict[str, int | None] = field(default_factory=dict)

    @property
    def accept_length(self) -> float | None:
        """Mean over the levels that reported one: the accept length the sweep ran at."""
        values = [a for a in self.accept_by_level.values() if a is not None and a > 0]
        return statistics.fmean(values) if values else None


async def sweep(
    urls: Mapping[str, str], levels: Sequence[int], shape: LoadShape, api_key: str | None,
    duration_s: float | None, requests: int | None, echo: bool = True,
) -> tuple[dict[str, list[LevelResult]], SweepFacts]:
    """Both pools, one after the other; returns the results and what the servers said."""
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
                if echo:
                    print(_row(result), flush=True)
    return results, facts


# --- deriving the policy ------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    crossover: float | None  # concurrency where the baseline catches up; None: never
    strategy: str
    patch: dict[str, Any]
    better: dict[int, str]  # per level, the pool with the higher output throughput


def crossover(eagle: Sequence[LevelResult], baseline: Sequence[LevelResult]) -> float | None:
    """First concurrency where baseline throughput >= EAGLE's, interpolated linearly in the
    throughput ratio from the last level EAGLE was ahead. 0.0: baseline ahead everywhere;
    None: EAGLE ahead at every level."""
    pairs = sorted(((e.concurrency, _ratio(e, b)) for e, b in zip(eagle, baseline, strict=True)))
    prev: tuple[int, float] | None = None
    for level, ratio in pairs:
        if ratio <= 1.0:
            if prev is None:
                return 0.0
            c0, r0 = prev
            return c0 + (r0 - 1.0) / (r0 - ratio) * (level - c0)
        prev = (level, ratio)
    return None


def _ratio(eagle: LevelResult, baseline: LevelResult) -> float:
    if baseline.throughput_tok_s <= 0:
        return math.inf
    return eagle.throughput_tok_s / baseline.throughput_tok_s


def recommend(results: Mapping[str, Sequence[LevelResult]], strategy: str) -> Recommendation:
    eagle, baseline = results["eagle"], results["baseline"]
    cross = crossover(eagle, baseline)
    better = {e.concurrency: ("eagle" if _ratio(e, b) > 1.0 else "baseline")
              for e, b in zip(eagle, baseline, strict=True)}
    top = max(e.concurrency for e in eagle)
    patch: dict[str, Any] = {"mode": "auto", "strategy": strategy}
    if strategy == "overflow":
        cap = top * 4 if cross is None else max(1, math.floor(cross))
        patch["eagle_cap"] = cap
    else:
        up, down = thresholds(cross, top)
        patch.update(switch_up=up, switch_down=down)
    return Recommendation(cross, strategy, patch, better)


FITS = ("table", "linear", "quadratic")


def fit_model(results: Mapping[str, Sequence[LevelResult]], facts: SweepFacts,
              fit: str = "table") -> GroupCostModel:
    """The group's cost model from the sweep.

    Each level is inverted into a step time at its batch (`step = 1000 * C * tokens per
    step / throughput`; a level above a server's max running requests decoded only that
    many at once, the rest waited, so it is inverted at that batch). `table` joins the
    points piecewise linearly, so the model reproduces the measured ratio at every level
    (and the measured crossover); `linear` / `quadratic` least-squares fit a curve
    (smoother, but a few % of error at small batches can move the crossover a lot).
    Raises ValueError when the sweep cannot give a model (no accept length, too few
    levels)."""
    accept = facts.accept_length
    if accept is None:
        raise ValueError("the EAGLE server reported no accept length during the sweep "
                         "(/v1/loads speculative.accept_length or /server_info "
                         "internal_states[].avg_spec_accept_length)")
    caps = {p: facts.max_running.get(p) for p in ("eagle", "baseline")}

    def points(pool: str) -> list[SweepPoint]:
        cap = caps[pool]
        return [SweepPoint(min(r.concurrency, cap) if cap else r.concurrency,
                           r.throughput_tok_s) for r in results[pool]]

    if fit != "table":
        return fit_group_model(points("baseline"), points("eagle"), accept,
                               quadratic=fit == "quadratic",
                               baseline_max_batch=caps["baseline"], eagle_max_batch=caps["eagle"])
    return GroupCostModel(_table(points("baseline"), 1.0), _table(points("eagle"), accept),
                          accept, caps["baseline"], caps["eagle"])


def _table(points: Sequence[SweepPoint], tokens_per_step: float) -> TableCurve:
    """Step times at each measured batch (levels sharing a batch, beyond a server's cap,
    averaged)."""
    by_batch: dict[int, list[float]] = {}
    for p in points:
        by_batch.setdefault(p.concurrency, []).append(step_ms_from_sweep(p, tokens_per_step))
    return TableCurve(tuple((float(b), statistics.fmean(v)) for b, v in by_batch.items()))


def model_report(model: GroupCostModel) -> str:
    """The fitted model's crossover at the sweep's accept length and around it."""
    def fmt(x: float | None) -> str:
        return "never (EAGLE-3 ahead)" if x is None else f"{x:.1f}"

    nominal = model.nominal_accept_length
    lines = [f"cost model (accept length {nominal:.2f}): crossover at "
             f"{fmt(model.crossover(nominal))} concurrent requests"]
    others = ", ".join(f"{a:g}: {fmt(model.crossover(a))}" for a in (1.6, 2.0, 2.5, 3.0, 4.0))
    lines.append(f"  crossover at other accept lengths: {others}")
    return "\n".join(lines)


def thresholds(cross: float | None, top_level: int) -> tuple[float, float]:
    """(switch_up, switch_down) in group-load units (requests in the group when a new one
    arrives, i.e. concurrency - 1 under a closed loop)."""
    # EAGLE ahead at every measured level: switch only well beyond them.
    up = float(top_level * 2) if cross is None else max(0.5, cross - 1.0)
    down = max(0.0, up - max(1.0, 0.25 * up))
    return round(up, 2), round(down, 2)


# --- output and applying ------------------------------------------------------------------


def _fmt(value: float | None, scale: float = 1000.0, unit: str = "ms") -> str:
    return "-" if value is None else f"{value * scale:.1f}{unit}"


def _row(r: LevelResult) -> str:
    return (f"{r.pool:9s} c={r.concurrency:<4d} reqs={r.requests:<5d} err={r.errors:<3d} "
            f"out={r.throughput_tok_s:9.1f} tok/s  p50={_fmt(r.median_latency_s)}  "
            f"p90={_fmt(r.p90_latency_s)}  ttft50={_fmt(r.median_ttft_s)}")


def report(results: Mapping[str, Sequence[LevelResult]], rec: Recommendation,
           accept: float | None) -> str:
    lines = ["", "level  eagle tok/s  baseline tok/s  ratio  eagle p50  baseline p50  better"]
    for e, b in zip(results["eagle"], results["baseline"], strict=True):
        lines.append(f"{e.concurrency:5d}  {e.throughput_tok_s:11.1f}  {b.throughput_tok_s:14.1f}"
                     f"  {_ratio(e, b):5.2f}  {_fmt(e.median_latency_s):>9s}  "
                     f"{_fmt(b.median_latency_s):>12s}  {rec.better[e.concurrency]}")
    cross = ("baseline ahead at every level" if rec.crossover == 0.0 else
             "EAGLE-3 ahead at every level" if rec.crossover is None else
             f"{rec.crossover:.2f} concurrent requests")
    lines.append(f"crossover: {cross}")
    if accept is not None:
        lines.append(f"EAGLE-3 accept length during the sweep: {accept:.2f}")
    lines.append(f"policy ({rec.strategy}): {json.dumps(rec.patch)}")
    return "\n".join(lines)


async def apply_policy(router_url: str, token: str, patch: Mapping[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        resp = await client.patch(router_url.rstrip("/") + "/policy", json=dict(patch),
                                  headers={"authorization": f"Bearer {token}"})
    if resp.status_code != 200:
        raise RuntimeError(f"PATCH /policy answered {resp.status_code}: {resp.text[:500]}")
    data: dict[str, Any] = resp.json()
    return data


# --- CLI ------------------------------------------------------------------------------------


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("concurrency levels: comma-separated integers") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return tuple(sorted(set(levels)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eagle-url", required=True, help="the group's EAGLE-3 server")
    parser.add_argument("--baseline-url", required=True, help="the group's baseline server")
    parser.add_argument("--api-key", help="the servers' API key (also: SPECROUTER_API_KEY)")
    parser.add_argument("--model", help="model name to send (default: the server's)")
    parser.add_argument("--concurrency", type=_levels, default=DEFAULT_LEVELS,
                        help="comma-separated levels (default 1,2,4,8,16,32,64)")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=float, help="seconds per level (default 20)")
    amount.add_argument("--requests", type=int, help="requests per level instead of a duration")
    parser.add_argument("--input-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--strategy", choices=["threshold", "overflow", "goodput"],
                        default="threshold",
                        help="policy to derive; goodput fits the group's cost model")
    parser.add_argument("--write-cost-model", metavar="FILE",
                        help="write the cost model fitted from the sweep (for the router's "
                             "cost_model.file / SPECROUTER_COST_MODEL__FILE)")
    parser.add_argument("--fit", choices=FITS, default="table",
                        help="cost model curves: table (through the measured levels, "
                             "default), linear (a + b*B) or quadratic (+ c*B^2)")
    parser.add_argument("--router-url", help="router whose /policy --apply changes")
    parser.add_argument("--admin-token", help="the router's admin token "
                                              "(also: SPECROUTER_ADMIN_TOKEN)")
    parser.add_argument("--apply", action="store_true", help="PATCH the policy into the router")
    parser.add_argument("--write-policy", metavar="FILE",
                        help="write the policy as JSON (for serve --policy-file)")
    parser.add_argument("--json", metavar="FILE", help="write all measurements as JSON")


def run(args: argparse.Namespace) -> int:
    import os

    token: str | None = args.admin_token or os.environ.get("SPECROUTER_ADMIN_TOKEN")
    if args.apply and not (args.router_url and token):
        print("specrouter calibrate: --apply needs --router-url and an admin token",
              file=sys.stderr)
        return 2
    if args.requests is not None and args.requests < 1:
        print("specrouter calibrate: --requests must be >= 1", file=sys.stderr)
        return 2
    duration = None if args.requests is not None else (args.duration or 20.0)
    shape = LoadShape(args.input_tokens, args.output_tokens, args.model)
    api_key = args.api_key or os.environ.get("SPECROUTER_API_KEY")
    urls = {"eagle": args.eagle_url, "baseline": args.baseline_url}
    try:
        results, facts = asyncio.run(sweep(urls, args.concurrency, shape, api_key,
                                           duration, args.requests))
    except KeyboardInterrupt:
        return 130
    if any(r.requests == 0 for rs in results.values() for r in rs):
        print("specrouter calibrate: a level completed no request; check the servers",
              file=sys.stderr)
        return 1
    accept = facts.accept_length
    rec = recommend(results, args.strategy)
    print(report(results, rec, accept))
    model: GroupCostModel | None = None
    if args.strategy == "goodput" or args.write_cost_model:
        try:
            model = fit_model(results, facts, args.fit)
        except ValueError as exc:
            print(f"specrouter calibrate: cannot fit the cost model: {exc}", file=sys.stderr)
            return 1
        print(model_report(model))
    if args.json:
        _write_json(args.json, {"levels": {p: [r.summary() for r in rs]
                                           for p, rs in results.items()},
                                "accept_length": accept,
                                "accept_length_by_level": facts.accept_by_level,
                                "max_running_requests": facts.max_running,
                                "crossover": rec.crossover, "policy": rec.patch,
                                "cost_model": None if model is None else model_to_dict(model),
                                "shape": asdict(shape)})
    if model is not None and args.write_cost_model:
        _write_json(args.write_cost_model, {**model_to_dict(model), "calibration": {
            "shape": asdict(shape), "levels": list(args.concurrency), "fit": args.fit,
            "crossover_measured": rec.crossover,
            "crossover_model": model.crossover(model.nominal_accept_length)}})
        print(f"cost model written to {args.write_cost_model} "
              f"(serve with SPECROUTER_COST_MODEL__FILE={args.write_cost_model})")
    if args.write_policy:
        _write_json(args.write_policy, rec.patch)
        print(f"policy written to {args.write_policy}")
    if args.apply and token:
        try:
            applied = asyncio.run(apply_policy(args.router_url, token, rec.patch))
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"specrouter calibrate: could not apply the policy: {exc}", file=sys.stderr)
            return 1
        print(f"applied to {args.router_url}: policy version {applied['policy']['version']}")
        if args.strategy == "goodput":
            print("note: the router predicts with the cost models of its own configuration "
                  "(cost_model / cost_models); a group without one uses the threshold band")
    return 0


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
