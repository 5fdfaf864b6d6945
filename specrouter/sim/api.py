"""The HTTP surface of one simulated SGLang 0.5.x server, as a Starlette app.

Routes, JSON shapes, status codes and the SSE format follow SGLang's http_server.py and its
OpenAI serving code; /sim/* is the simulator's own control surface. Generation requests become
SimRequests on the engine; a handler never computes physics, it only waits for the engine's
tokens and renders them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from specrouter.sim import physics, protocol
from specrouter.sim.engine import Engine, QueueFull, SimRequest
from specrouter.sim.faults import ControlError, Faults, apply_control
from specrouter.sim.metrics import EngineMetrics
from specrouter.sim.profile import ProfileError, parse_schedule
from specrouter.sim.text import WordStream, request_rng

SGLANG_VERSION = "0.5.10"  # the server version this surface imitates (reported in /server_info)
AUTH_EXEMPT_PREFIXES = ("/health", "/metrics", "/ready", "/sim/")


@dataclass
class ServerSettings:
    host: str
    port: int
    served_model_name: str
    api_key: str | None
    seed: int
    group: str


@dataclass
class SimServer:
    """Everything one engine's HTTP app needs; shared by the route handlers."""

    engine: Engine
    settings: ServerSettings
    faults: Faults = field(default_factory=Faults)
    listener: Any = None  # specrouter.sim.server.Listener: refuse/accept connections
    # every engine of the group by kind, so one engine's /sim/control can reach a sibling
    # whose port is closed by the refuse_connections fault
    group_servers: dict[str, SimServer] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    metrics: EngineMetrics | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(f"faults:{self.settings.seed}:{self.engine.kind}")
        self.metrics = EngineMetrics(self.engine, self.settings.served_model_name)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status,
                    media_type="application/json")


def error_response(message: str, err_type: str = "BadRequestError", code: int = 400) -> Response:
    return json_response(protocol.error_body(message, err_type, code), code)


class ApiKeyMiddleware:
    """SGLang's --api-key check: Bearer token on everything but health, readiness, metrics."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.expected is None or scope["type"] != "http" or scope["method"] == "OPTIONS"
                or scope["path"].startswith(AUTH_EXEMPT_PREFIXES)):
            await self.app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization")
        if auth != self.expected:
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EngineStream(Response):
    """SSE response that aborts the engine request the moment the client disconnects.

    It listens for http.disconnect itself instead of relying on a failed write, because a
    request still waiting in the queue writes nothing for a long time, and SGLang frees the
    slot at once."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        # no super().__init__: it would add a content-length header to a streamed body
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self.body_iter = body
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        producer = asyncio.ensure_future(self._produce(send))
        try:
            await asyncio.wait({watcher, producer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not producer.done():
                producer.cancel()
                self.on_disconnect()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await producer
            watcher.cancel()
        if producer.done() and not producer.cancelled():
            producer.result()

    async def _produce(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.body_iter:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class StreamCut(Exception):
    """Injected fault: end the connection mid-stream without the terminating chunk."""


# --- generation --------------------------------------------------------------------------------

Parser = Callable[[Any, float, str], protocol.GenParams]


class Generation:
    """One generation request's text, stop-string matching and finish bookkeeping."""

    def __init__(self, server: SimServer, req: SimRequest, params: protocol.GenParams) -> None:
        self.server = server
        self.req = req
        self.params = params
        self.text = ""
        self.consumed = 0
        self.matched_stop_str: str | None = None
        self.sent_tokens = 0

    async def pieces(self) -> AsyncIterator[str]:
        """New text after each engine step (several tokens at once on EAGLE)."""
        req = self.req
        while True:
            await req.event.wait()
            req.event.clear()
            n = req.generated - self.consumed
            if n > 0:
                self.consumed += n
                piece = req.words.take(n)
                piece = self._apply_stop(piece)
                if piece:
                    yield piece
            if req.done:
                return

    def _apply_stop(self, piece: str) -> str:
        if not self.params.stop:
            self.text += piece
            return piece
        before = len(self.text)
        self.text += piece
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s)) >= 0]
        if not hits:
            return piece
        index, stop_str = min(hits)
        self.text = self.text[:index]
        self.matched_stop_str = stop_str
        self.server.engine.finish_early(self.req, "stop")
        return self.text[before:]

    @property
    def finish_reason(self) -> str:
        return self.req.finish_reason or "abort"

    @property
    def matched(self) -> int | str | None:
        return protocol.matched_stop(self.finish_reason, self.matched_stop_str)

    def observe(self) -> None:
        """Latency histograms in simulated seconds."""
        req, metrics, clock = self.req, self.server.metrics, self.server.engine.clock
        if metrics is None or req.first_token_real is None or req.last_token_real is None:
            return
        scale = clock.time_scale
        metrics.ttft.observe((req.first_token_real - req.arrival_real) / scale)
        metrics.e2e.observe((req.last_token_real - req.arrival_real) / scale)
        if req.generated > 1:
            metrics.itl.observe((req.last_token_real - req.first_token_real) / scale
                                / (req.generated - 1))


async def _read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise protocol.BadRequest(f"Invalid JSON body: {exc}") from None


async def _admit(server: SimServer, request: Request, parser: Parser
                 ) -> tuple[Generation | None, Response | None]:
    """Parse, apply injected faults and validation, and queue the request on the engine."""
    engine, profile = server.engine, server.engine.profile
    try:
        params = parser(await _read_json(request), profile.chars_per_token,
                        server.settings.served_model_name)
    except protocol.BadRequest as exc:
        return None, error_response(str(exc))
    faults = server.faults
    if faults.added_latency_ms > 0:
        await asyncio.sleep(faults.added_latency_ms / 1000.0)
    if faults.stall:
        await wait_disconnect(request.receive)
        return None, Response(status_code=499)
    if faults.should_error(server.rng):
        return None, error_response("Internal server error (injected by the simulator)",
                                    "InternalServerError", faults.error_status)
    max_new = params.max_new_tokens
    if max_new is None:
        max_new = max(1, profile.context_length - params.prompt_tokens)
    if params.prompt_tokens + max_new > profile.context_length:
        return None, error_response(
            f"Requested token count exceeds the model's maximum context length of "
            f"{profile.context_length} tokens. You requested a total of "
            f"{params.prompt_tokens + max_new} tokens: {params.prompt_tokens} tokens from the "
            f"input messages and {max_new} tokens for the completion. Please reduce the number "
            f"of tokens in the input messages or the completion to fit within the limit.")
    rng = request_rng(server.settings.seed, params.prompt_key)
    stop_at = max_new if params.ignore_eos else min(max_new,
                                                    physics.sample_output_length(profile, rng))
    req = SimRequest(engine.new_rid(), params.prompt_tokens, max_new, stop_at, WordStream(rng),
                     engine.clock.real())
    try:
        engine.submit(req)
    except QueueFull:
        return None, error_response("The request queue is full.", "ServiceUnavailableError", 503)
    return Generation(server, req, params), None


async def _wait_done(server: SimServer, gen: Generation, request: Request) -> bool:
    """Collect the whole output; False if the client left (the request is then aborted)."""
    collector = asyncio.ensure_future(_drain(gen))
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
            server.engine.abort(gen.req)
    return collector.done() and not collector.cancelled()


async def _drain(gen: Generation) -> None:
    async for _ in gen.pieces():
        pass


def _cut_limit(server: SimServer) -> int | None:
    return server.faults.cut_stream_after_tokens


Responder = Callable[[str, str, str, str, int | str | None, int, int], dict[str, Any]]
EventStream = Callable[[SimServer, Generation, str, str], AsyncIterator[bytes]]


async def _generate(request: Request, parser: Parser, respond: Responder,
                    events: EventStream) -> Response:
    """Both OpenAI endpoints serve a generation the same way and differ only in the body
    shapes: admit it, then answer the whole text at the end or stream it as it comes."""
    server: SimServer = request.app.state.sim
    gen, error = await _admit(server, request, parser)
    if gen is None:
        assert error is not None
        return error
    rid, model = gen.req.rid, gen.params.model
    if not gen.params.stream:
        if not await _wait_done(server, gen, request):
            return Response(status_code=499)
        gen.observe()
        return json_response(respond(
            rid, model, gen.text, gen.finish_reason, gen.matched, gen.req.prompt_tokens,
            gen.req.generated))
    return EngineStream(events(server, gen, rid, model),
                        lambda: server.engine.abort(gen.req))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, protocol.parse_chat, protocol.chat_response, _chat_events)


async def _chat_events(server: SimServer, gen: Generation, rid: str, model: str
                       ) -> AsyncIterator[bytes]:
    created = int(time.time())
    # SGLang sends the role chunk when the first output comes back from the scheduler
    # (serving_chat.py `_generate_chat_stream`, `is_firsts`), not at admission: until
    # prefill ends, a stream carries no byte after its headers.
    role = protocol.sse(protocol.chat_chunk(rid, model, created,
                                            {"role": "assistant", "content": ""}))
    async for piece in gen.pieces():
        if role:
            yield role
            role = b""
        yield protocol.sse(protocol.chat_chunk(rid, model, created, {"content": piece}))
        _maybe_cut(server, gen)
    if role:  # finished without text (a stop string at once): SGLang still sends it
        yield role
    gen.observe()
    yield protocol.sse(protocol.chat_chunk(
        rid, model, created, {}, gen.finish_reason, gen.matched,
        protocol.usage(gen.req.prompt_tokens, gen.req.generated)))
    if gen.params.include_usage:
        yield protocol.sse(protocol.usage_chunk(rid, model, created, "chat.completion.chunk",
                                                gen.req.prompt_tokens, gen.req.generated))
    yield protocol.SSE_DONE


def _maybe_cut(server: SimServer, gen: Generation) -> None:
    limit = _cut_limit(server)
    if limit is not None and gen.consumed >= limit:
        server.engine.abort(gen.req)
        raise StreamCut(f"stream cut after {gen.consumed} tokens (injected)")


async def completions(request: Request) -> Response:
    return await _generate(request, protocol.parse_completion, protocol.completion_response,
                           _completion_events)


async def _completion_events(server: SimServer, gen: Generation, rid: str, model: str
                             ) -> AsyncIterator[bytes]:
    created = int(time.time())
    async for piece in gen.pieces():
        yield protocol.sse(protocol.completion_chunk(rid, model, created, piece))
        _maybe_cut(server, gen)
    gen.observe()
    yield protocol.sse(protocol.completion_chunk(rid, model, created, "", gen.finish_reason,
                                                 gen.matched))
    if gen.params.include_usage:
        yield protocol.sse(protocol.usage_chunk(rid, model, created, "text_completion",
                                                gen.req.prompt_tokens, gen.req.generated))
    yield protocol.SSE_DONE


async def generate(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    gen, error = await _admit(server, request, protocol.parse_generate)
    if gen is None:
        assert error is not None
        return error
    if not gen.params.stream:
        if not await _wait_done(server, gen, request):
            return Response(status_code=499)
        gen.observe()
        return json_response(_generate_body(server, gen))
    return EngineStream(_generate_events(server, gen), lambda: server.engine.abort(gen.req))


def _generate_body(server: SimServer, gen: Generation) -> dict[str, Any]:
    req = gen.req
    now = server.engine.clock.real()
    return {
        "text": gen.text,
        "output_ids": [],
        "meta_info": {
            "id": req.rid,
            "finish_reason": None if not req.done else protocol.generate_finish(
                gen.finish_reason, gen.matched, req.generated),
            "prompt_tokens": req.prompt_tokens,
            "weight_version": "default",
            "completion_tokens": req.generated,
            "cached_tokens": 0,
            "e2e_latency": (now - req.arrival_real) / server.engine.clock.time_scale,
        },
    }


async def _generate_events(server: SimServer, gen: Generation) -> AsyncIterator[bytes]:
    async for _ in gen.pieces():
        yield protocol.sse(_generate_body(server, gen))
        _maybe_cut(server, gen)
    gen.observe()
    if gen.req.done and gen.consumed == gen.req.generated:
        yield protocol.sse(_generate_body(server, gen))
    yield protocol.SSE_DONE


# --- health and information ---------------------------------------------------------------------

async def _slow_health(server: SimServer) -> None:
    if server.faults.slow_health_ms > 0:
        await asyncio.sleep(server.faults.slow_health_ms / 1000.0)


async def health(request: Request) -> Response:
    """SGLang runs a 1-token generation and polls for progress once a second (scaled here)."""
    server: SimServer = request.app.state.sim
    await _slow_health(server)
    if server.faults.stall:
        await wait_disconnect(request.receive)
        return Response(status_code=503)
    engine = server.engine
    rng = request_rng(server.settings.seed, "health")
    req = SimRequest(engine.new_rid(), 4, 1, 1, WordStream(rng), engine.clock.real())
    engine.submit(req)
    try:
        await asyncio.wait_for(req.event.wait(), timeout=20.0 * engine.clock.time_scale + 5.0)
    except TimeoutError:
        engine.abort(req)
        return Response(status_code=503)
    await asyncio.sleep(min(1.0, engine.clock.time_scale))
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    await _slow_health(server)
    return json_response({"status": "ready"})


async def models(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    profile = server.engine.profile
    return json_response({"object": "list", "data": [{
        "id": server.settings.served_model_name, "object": "model",
        "created": int(server.engine.started_at), "owned_by": "sglang",
        "root": profile.model_path, "parent": None, "max_model_len": profile.context_length,
    }]})


async def model_info(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    profile = server.engine.profile
    return json_response({
        "model_path": profile.model_path, "tokenizer_path": profile.model_path,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "served_model_name": server.settings.served_model_name,
    })


def _internal_state(server: SimServer) -> dict[str, Any]:
    engine = server.engine
    state: dict[str, Any] = {
        "last_gen_throughput": engine.gauges.gen_throughput,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity":
                         engine.limits.kv_capacity_tokens, "graph": 0.0},
        "effective_max_running_requests_per_dp": engine.limits.max_running_requests,
    }
    if engine.is_eagle:
        state["avg_spec_accept_length"] = engine.observed_accept_length()
    return state


def server_args(server: SimServer) -> dict[str, Any]:
    """The flat server-args dump of /server_info (a representative subset, secrets omitted)."""
    engine, profile, s = server.engine, server.engine.profile, server.settings
    eagle = engine.is_eagle
    return {
        "model_path": profile.model_path, "tokenizer_path": profile.model_path,
        "served_model_name": s.served_model_name, "host": s.host, "port": s.port,
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "context_length": profile.context_length,
        "mem_fraction_static": None, "max_running_requests": engine.limits.max_running_requests,
        "max_total_tokens": engine.limits.kv_capacity_tokens,
        "max_queued_requests": engine.max_queued_requests,
        "chunked_prefill_size": profile.chunked_prefill_size, "schedule_policy": "fcfs",
        "enable_metrics": True, "decode_log_interval": 40,
        "speculative_algorithm": "EAGLE3" if eagle else None,
        "speculative_draft_model_path": f"{profile.model_path}-EAGLE3" if eagle else None,
        "speculative_num_steps": profile.draft.steps if eagle else None,
        "speculative_eagle_topk": profile.draft.topk if eagle else None,
        "speculative_num_draft_tokens": profile.draft.num_draft_tokens if eagle else None,
        "random_seed": s.seed,
    }


async def server_info(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    return json_response({**server_args(server), "max_total_num_tokens":
                          server.engine.limits.kv_capacity_tokens,
                          "internal_states": [_internal_state(server)],
                          "version": SGLANG_VERSION})


async def get_load(request: Request) -> Response:
    engine: Engine = request.app.state.sim.engine
    waiting = len(engine.waiting)
    return json_response([{"dp_rank": 0, "num_reqs": engine.num_running + waiting,
                           "num_waiting_reqs": waiting, "num_tokens": engine.used_tokens()}])


LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
KV_BYTES_PER_TOKEN = 131072  # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x (K,V) x bf16


def _load_entry(engine: Engine, include: frozenset[str]) -> dict[str, Any]:
    """One GetLoadsReqOutput as SGLang's /v1/loads renders it: None sections left out."""
    snap, cap = engine.loads, engine.limits.kv_capacity_tokens
    everything = "all" in include
    entry: dict[str, Any] = {"dp_rank": 0}
    if everything or "core" in include:
        entry.update({
            "num_running_reqs": snap.num_running_reqs, "num_waiting_reqs": snap.num_waiting_reqs,
            "num_used_tokens": snap.num_used_tokens, "num_total_tokens": snap.num_used_tokens,
            "max_total_num_tokens": cap, "token_usage": round(snap.num_used_tokens / cap, 4),
            "gen_throughput": round(snap.gen_throughput, 2), "cache_hit_rate": 0.0,
            "utilization": round(snap.num_running_reqs / engine.limits.max_running_requests, 4),
            "max_running_requests": engine.limits.max_running_requests,
        })
    if everything or "memory" in include:
        entry["memory"] = {"weight_gb": 16.06, "kv_cache_gb": round(
            cap * KV_BYTES_PER_TOKEN / 2**30, 2), "graph_gb": 0.5, "token_capacity": cap}
    if engine.is_eagle and (everything or "spec" in include):
        drafts = engine.profile.draft.num_draft_tokens - 1
        entry["speculative"] = {
            "accept_length": round(snap.accept_length, 4),
            "accept_rate": round(max(0.0, (snap.accept_length - 1) / drafts), 4)
            if snap.accept_length else 0.0,
        }
    if everything or "queues" in include:
        entry["queues"] = {"waiting": snap.num_waiting_reqs, "grammar": 0, "paused": 0,
                           "retracted": 0}
    if "num_running_reqs" in entry:
        entry["num_total_reqs"] = entry["num_running_reqs"] + entry["num_waiting_reqs"]
    return entry


def _aggregate(entry: dict[str, Any]) -> dict[str, Any]:
    running, waiting = entry.get("num_running_reqs", 0), entry.get("num_waiting_reqs", 0)
    return {"total_running_reqs": running, "total_waiting_reqs": waiting,
            "total_reqs": running + waiting, "avg_token_usage": entry.get("token_usage", 0.0),
            "avg_throughput": entry.get("gen_throughput", 0.0),
            "avg_utilization": entry.get("utilization", 0.0)}


async def v1_loads(request: Request) -> Response:
    """GET /v1/loads?include=core,spec,...&dp_rank=N (SGLang's entrypoints/v1_loads.py)."""
    engine: Engine = request.app.state.sim.engine
    raw = request.query_params.get("include")
    include = frozenset(s.strip() for s in raw.split(",")) if raw else frozenset({"all"})
    invalid = include - LOAD_SECTIONS
    if invalid:
        return error_response(f"Invalid include sections: {sorted(invalid)}. "
                              f"Valid options: {sorted(LOAD_SECTIONS)}")
    dp_rank = request.query_params.get("dp_rank")
    entries = [_load_entry(engine, include)] if dp_rank in (None, "0") else []
    return json_response({
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": SGLANG_VERSION, "dp_rank_count": len(entries), "loads": entries,
        "aggregate": _aggregate(entries[0]) if entries else _aggregate({}),
    })


async def metrics(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    assert server.metrics is not None
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# --- /sim/ control ----------------------------------------------------------------------------

async def sim_control(request: Request) -> Response:
    """POST /sim/control: faults and accept length of this engine, or of the sibling named by
    an "engine" field ("eagle" | "baseline")."""
    own: SimServer = request.app.state.sim
    try:
        body = await _read_json(request)
    except protocol.BadRequest as exc:
        return error_response(str(exc))
    if not isinstance(body, dict):
        return error_response("control body must be a JSON object")
    fields = dict(body)
    target = fields.pop("engine", own.engine.kind)
    server = own.group_servers.get(target) if target != own.engine.kind else own
    if server is None:
        return error_response(f"no engine {target!r} in this group")
    try:
        accept = fields.pop("accept_length", None)
        schedule = fields.pop("accept_length_schedule", None)
        seed = fields.pop("seed", None)
        _check_accept(server, accept, schedule)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ControlError("seed must be an integer")
        apply_control(server.faults, fields)
    except (ControlError, ProfileError) as exc:
        return error_response(str(exc))
    if seed is not None:
        server.engine.reseed(seed)
    if accept is not None:
        server.engine.set_accept_length(float(accept))
    if schedule is not None:
        server.engine.set_accept_schedule(parse_schedule(schedule))
    if "refuse_connections" in fields and server.listener is not None:
        await server.listener.set_refusing(server.faults.refuse_connections,
                                           server.faults.refuse_for_s, server.faults)
    return json_response(sim_state(server))


def _check_accept(server: SimServer, accept: Any, schedule: Any) -> None:
    limit = physics.max_accept(server.engine.profile)
    if accept is not None and (isinstance(accept, bool) or not isinstance(accept, int | float)
                               or not 1 <= accept <= limit):
        raise ControlError(f"accept_length must be a number within 1..{limit}")
    if schedule is not None:
        for _, value in parse_schedule(schedule):
            if value > limit:
                raise ControlError(f"accept lengths in the schedule must be <= {limit}")


def sim_state(server: SimServer) -> dict[str, Any]:
    engine, c = server.engine, server.engine.counters
    return {
        "engine": engine.kind, "group": server.settings.group, "port": server.settings.port,
        "running": engine.num_running, "waiting": len(engine.waiting),
        "admitted": c.admitted, "finished": c.finished, "aborted": c.aborted,
        "abort_times": list(c.abort_times), "monotonic_now": time.monotonic(),
        "requests": c.requests, "prompt_tokens": c.prompt_tokens,
        "generated_tokens": c.generated_tokens, "decode_steps": c.decode_steps,
        "prefill_steps": c.prefill_steps, "busy_sim_s": c.busy_sim_s,
        "gpu_busy_sim_s": engine.gpu.busy_sim_s, "sim_now": engine.clock.sim_now(),
        "time_scale": engine.clock.time_scale, "dropped_real_s": c.dropped_real_s,
        "max_late_real_s": c.max_late_real_s, "used_tokens": engine.used_tokens(),
        "accept_length": engine.accept_length() if engine.is_eagle else None,
        "observed_accept_length": engine.observed_accept_length() if engine.is_eagle else None,
        "max_running_requests": engine.limits.max_running_requests,
        "kv_capacity_tokens": engine.limits.kv_capacity_tokens,
        "profile": engine.profile.name, "faults": server.faults.as_dict(),
    }


async def sim_state_route(request: Request) -> Response:
    return json_response(sim_state(request.app.state.sim))


Handler = Callable[[Request], Awaitable[Response]]


def build_app(server: SimServer) -> ASGIApp:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/v1/loads", v1_loads, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/control", sim_control, methods=["POST"]),
        Route("/sim/state", sim_state_route, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.sim = server
    return ApiKeyMiddleware(app, server.settings.api_key)


