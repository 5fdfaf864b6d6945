"""The HTTP surface of one simulated SGLang server (0.5.23 or 0.5.10), as a Starlette app.

Routes, JSON shapes, status codes and the SSE format follow the chosen release's
http_server.py and OpenAI serving code (SglangVersion says what differs); /sim/* is the
simulator's own control surface. Generation requests become SimRequests on the engine; a
handler never computes physics, it only waits for the engine's outputs and renders them.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from specrouter.sim import loads, physics, protocol
from specrouter.sim.disconnect import abandon
from specrouter.sim.engine import Engine, QueueFull, SimRequest
from specrouter.sim.faults import ControlError, Faults, apply_control
from specrouter.sim.metrics import EngineMetrics
from specrouter.sim.profile import ProfileError, parse_schedule
from specrouter.sim.residence import Residences, Stay
from specrouter.sim.text import WordStream, request_rng
from specrouter.sim.version import (
    HEALTH_CHECK_TIMEOUT_S,
    HEALTH_POLL_S,
    V0_5_23,
    SglangVersion,
)

AUTH_EXEMPT_PREFIXES = ("/health", "/metrics", "/ready", "/sim/")


@dataclass
class ServerSettings:
    host: str
    port: int
    served_model_name: str
    api_key: str | None
    seed: int
    group: str
    version: SglangVersion = V0_5_23
    priority_scheduling: bool = False
    enable_cache_report: bool = False  # SGLang's --enable-cache-report


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
    # SGLang's ServerStatus as far as /ready sees it: only a failed /health makes it
    # UnHealthy, a later successful one makes it Up again
    healthy: bool = True
    background: set[asyncio.Task[None]] = field(default_factory=set)
    residences: Residences = field(default_factory=Residences)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"faults:{self.settings.seed}:{self.engine.kind}")
        self.metrics = EngineMetrics(self.engine, self.settings.served_model_name,
                                     self.settings.version, self.settings.priority_scheduling)

    @property
    def version(self) -> SglangVersion:
        return self.settings.version

    def prompt_details(self, req: SimRequest) -> dict[str, Any] | None:
        """usage.prompt_tokens_details as this release writes it."""
        return protocol.cache_details(self.settings.enable_cache_report, req.cached,
                                      self.version.cache_report_omits_zero)

    def run_in_background(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status,
                    media_type="application/json")


def error_response(message: str, err_type: str = protocol.VALUE_ERROR, code: int = 400
                   ) -> Response:
    return json_response(protocol.error_body(message, err_type, code), code)


def not_found() -> Response:
    """FastAPI's answer to a route this release does not have."""
    return json_response({"detail": "Not Found"}, 404)


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
    """SSE response whose head leaves with the first event, as SGLang's: the handler awaits
    the first chunk before it returns the StreamingResponse (serving_chat.py:2413-2439), so a
    queued or prefilling stream has sent no byte at all.

    It listens for http.disconnect itself (a queued stream writes nothing for a long time) and
    hands a gone client's request to `disconnect.abandon`, which aborts it when SGLang would."""

    media_type = "text/event-stream"

    def __init__(self, server: SimServer, gen: Generation, body: AsyncIterator[bytes]) -> None:
        # no super().__init__: it would add a content-length header to a streamed body
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self.server = server
        self.gen = gen
        self.body_iter = body
        self.head_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        producer = asyncio.ensure_future(self._produce(send))
        try:
            await asyncio.wait({watcher, producer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not producer.done():
                producer.cancel()
                self.gen.abandon(stream=True, head_sent=self.head_sent)
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await producer
            watcher.cancel()
        if producer.done() and not producer.cancelled():
            producer.result()

    async def _produce(self, send: Send) -> None:
        async for chunk in self.body_iter:
            if not self.head_sent:
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.raw_headers})
                self.head_sent = True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class StreamCut(Exception):
    """Injected fault: end the connection mid-stream without the terminating chunk."""


# --- generation --------------------------------------------------------------------------------

Parser = Callable[[Any, float, str], protocol.GenParams]


class Generation:
    """One generation request's text, stop-string matching and finish bookkeeping."""

    def __init__(self, server: SimServer, req: SimRequest, params: protocol.GenParams,
                 stay: Stay) -> None:
        self.server = server
        self.req = req
        self.params = params
        self.stay = stay
        self.text = ""
        self.consumed = 0
        self.matched_stop_str: str | None = None
        self.last_output_real = req.arrival_real  # when the tokenizer last began to wait

    async def outputs(self) -> AsyncIterator[str]:
        """One item per scheduler output, as SGLang's tokenizer yields them: the new text
        (several tokens at once on EAGLE, possibly empty); the last one finds req.done."""
        req = self.req
        while True:
            await req.event.wait()
            req.event.clear()
            n = req.generated - self.consumed
            piece = ""
            if n > 0:
                self.consumed += n
                piece = self._apply_stop(req.words.take(n))
            if req.done and req.finish_reason != "abort":
                self.server.engine.cache_output(req, self.text)
            if n > 0:
                self.stay.saw_first_token()
            elif req.done:
                self.stay.leave()
            if n > 0 or req.done:
                self.last_output_real = self.server.engine.clock.real()
                yield piece
            if req.done:
                return

    def abandon(self, *, stream: bool, head_sent: bool) -> None:
        """The client left: abort the request when SGLang would (disconnect.py)."""
        self.stay.leave()
        self.server.run_in_background(abandon(
            self.server.engine, self.req, self.server.version, stream=stream,
            head_sent=head_sent, last_wait_start_real=self.last_output_real))

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
        itl = ((req.last_token_real - req.first_token_real) / scale / (req.generated - 1)
               if req.generated > 1 else None)
        metrics.observe_finished(
            self.params.stream, req.prompt_tokens, req.generated,
            (req.first_token_real - req.arrival_real) / scale,
            (req.last_token_real - req.arrival_real) / scale, itl)


async def _read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise protocol.BadRequest(f"Invalid JSON body: {exc}") from None


def _json_content_type(request: Request) -> bool:
    """validate_json_request: the OpenAI routes take application/json only."""
    media = request.headers.get("content-type", "").lower().split(";", maxsplit=1)[0]
    return media.strip() == "application/json"


class Rejected(Exception):
    """The scheduler refused the request at once (the waiting queue is full)."""


async def _admit(server: SimServer, request: Request, parser: Parser
                 ) -> tuple[Generation | None, Response | None]:
    """Parse, apply injected faults and validation, and queue the request on the engine."""
    engine, profile = server.engine, server.engine.profile
    if request.url.path.startswith("/v1/") and not _json_content_type(request):
        return None, error_response("Unsupported Media Type: Only 'application/json' is "
                                    "allowed", protocol.VALIDATION_ERROR)
    try:
        body = await _read_json(request)
        params = protocol.with_ids(parser(body, profile.chars_per_token,
                                          server.settings.served_model_name), body)
    except protocol.BadRequest as exc:
        return None, error_response(str(exc), protocol.VALIDATION_ERROR)
    if params.rid is not None and params.rid in engine.by_rid:
        return None, error_response(f"Duplicate request ID: {params.rid}")
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
    req = SimRequest(params.rid or engine.new_rid(), params.prompt_tokens, max_new, stop_at,
                     WordStream(rng), engine.clock.real(), priority=params.priority,
                     blocks=params.blocks)
    gen = Generation(server, req, params,
                     server.residences.begin(request.headers.get("x-request-id")))
    try:
        engine.submit(req)
    except QueueFull:
        if not params.stream:  # the tokenizer raises HTTPException(503): type "503"
            gen.stay.leave()
            return None, error_response(protocol.QUEUE_FULL_MESSAGE, "503", 503)
        req.state, req.finish_reason = "done", "queue_full"
        req.event.set()
    return gen, None


async def _wait_done(server: SimServer, gen: Generation, request: Request) -> bool:
    """Collect the whole output; False if the client left (the request is then abandoned)."""
    collector = asyncio.ensure_future(_drain(gen))
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
            gen.abandon(stream=False, head_sent=False)
    return collector.done() and not collector.cancelled()


async def _drain(gen: Generation) -> None:
    async for _ in gen.outputs():
        pass


def _cut_limit(server: SimServer) -> int | None:
    return server.faults.cut_stream_after_tokens


Responder = Callable[[str, str, str, str, int | str | None, int, int, dict[str, Any] | None],
                     dict[str, Any]]
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
            gen.req.generated, server.prompt_details(gen.req)))
    return EngineStream(server, gen, events(server, gen, rid, model))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, protocol.parse_chat, protocol.chat_response, _chat_events)


def _error_event(server: SimServer, gen: Generation) -> bytes | None:
    """The SSE error event that replaces the finish chunk: a queue-full abort (both releases)
    or, on 0.5.10, any abort (serving_chat.py 0.5.10:697-710, 0.5.23:2568-2580)."""
    if gen.req.finish_reason == "queue_full":
        return protocol.sse_error(protocol.QUEUE_FULL_MESSAGE, "SERVICE_UNAVAILABLE", 503)
    if gen.finish_reason == "abort" and server.version.graceful_abort_is_error_event:
        return protocol.sse_error("Aborted", "INTERNAL_SERVER_ERROR", 500)
    return None


def _usage_chunk(server: SimServer, gen: Generation, rid: str, model: str, created: int,
                 obj: str) -> bytes:
    return protocol.sse(protocol.usage_chunk(
        rid, model, created, obj, gen.req.prompt_tokens, gen.req.generated,
        server.version.usage_has_completion_details, server.prompt_details(gen.req)))


async def _chat_events(server: SimServer, gen: Generation, rid: str, model: str
                       ) -> AsyncIterator[bytes]:
    """Role chunk with the first output (`is_firsts`), one content chunk per output with
    text, a finish chunk without usage, the usage chunk only with include_usage, [DONE]
    (serving_chat.py 0.5.23:2582-2662,2766-2805)."""
    created = int(time.time())
    omit = server.version.chat_chunks_omit_none
    first = True
    async for piece in gen.outputs():
        error = _error_event(server, gen) if gen.req.done else None
        if error is not None:
            yield error
            break
        if first:
            first = False
            yield protocol.sse(protocol.chat_chunk(
                rid, model, created, {"role": "assistant", "content": ""}, omit_none=omit))
        if piece:
            yield protocol.sse(protocol.chat_chunk(rid, model, created, {"content": piece},
                                                   omit_none=omit))
        _maybe_cut(server, gen)
        if gen.req.done:
            gen.observe()
            yield protocol.sse(protocol.chat_chunk(rid, model, created, {}, gen.finish_reason,
                                                   gen.matched, omit_none=omit))
    if gen.params.include_usage:
        yield _usage_chunk(server, gen, rid, model, created, "chat.completion.chunk")
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
    """One chunk per output; the last output's chunk carries finish_reason with its text
    (serving_completions.py 0.5.23:355-399): no separate empty finish chunk."""
    created = int(time.time())
    async for piece in gen.outputs():
        done = gen.req.done
        error = _error_event(server, gen) if done else None
        if error is not None:
            yield error
            break
        if done:
            gen.observe()
        yield protocol.sse(protocol.completion_chunk(
            rid, model, created, piece, gen.finish_reason if done else None,
            gen.matched if done else None))
        _maybe_cut(server, gen)
    if gen.params.include_usage:
        yield _usage_chunk(server, gen, rid, model, created, "text_completion")
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
    return EngineStream(server, gen, _generate_events(server, gen))


def _generate_body(server: SimServer, gen: Generation) -> dict[str, Any]:
    req = gen.req
    now = server.engine.clock.real()
    if req.finish_reason == "queue_full":
        finish: dict[str, Any] | None = protocol.queue_full_finish()
    else:
        finish = None if not req.done else protocol.generate_finish(
            gen.finish_reason, gen.matched, req.generated)
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": finish, "prompt_tokens": req.prompt_tokens,
        "weight_version": "default", "completion_tokens": req.generated,
        "cached_tokens": req.cached,
        "e2e_latency": (now - req.arrival_real) / server.engine.clock.time_scale,
    }
    if req.verify_steps > 0:  # tokenizer_manager.py:3148-3172
        proposed = req.proposed_drafts
        meta.update({
            "spec_accept_rate": req.correct_drafts / proposed if proposed else 0.0,
            "spec_accept_length": req.generated / req.verify_steps,
            "spec_num_correct_drafts": req.correct_drafts,
            "spec_num_proposed_drafts": proposed, "spec_verify_ct": req.verify_steps,
        })
    return {"text": gen.text, "output_ids": [], "meta_info": meta}


async def _generate_events(server: SimServer, gen: Generation) -> AsyncIterator[bytes]:
    """`data: <output>` per output, cumulative text, the finished output once, [DONE]
    (http_server.py 0.5.23:948-975)."""
    async for _ in gen.outputs():
        if gen.req.done:
            gen.observe()
        yield protocol.sse(_generate_body(server, gen))
        _maybe_cut(server, gen)
    yield protocol.SSE_DONE


# --- health and information ---------------------------------------------------------------------

async def _slow_health(server: SimServer) -> None:
    if server.faults.slow_health_ms > 0:
        await asyncio.sleep(server.faults.slow_health_ms / 1000.0)


async def health(request: Request) -> Response:
    """/health and /health_generate (http_server.py 0.5.23:721-799): 503 while starting; else
    a 1-token request that a busy scheduler does not queue (any output after the call counts),
    polled once a (simulated) second; no output within 20 s: 503, and the server turns
    UnHealthy, which /ready then reports."""
    server: SimServer = request.app.state.sim
    await _slow_health(server)
    if server.faults.stall:
        await wait_disconnect(request.receive)
        return Response(status_code=503)
    if server.faults.starting:
        return Response(status_code=503)
    engine = server.engine
    steps_at_call = engine.steps_done
    deadline = engine.clock.real() + HEALTH_CHECK_TIMEOUT_S * engine.clock.time_scale
    try:
        engine.health_check()
    except QueueFull:  # SGLang's health request meets the full queue as an abort: an answer
        server.healthy = True
        return Response(status_code=200)
    while engine.clock.real() < deadline:
        await asyncio.sleep(HEALTH_POLL_S * engine.clock.time_scale)
        if engine.steps_done > steps_at_call:
            server.healthy = True
            return Response(status_code=200)
    server.healthy = False
    return Response(status_code=503)


async def ready(request: Request) -> Response:
    """0.5.23 only (http_server.py:714-718): 200/503, empty body, from the server status,
    which only /health changes: a wedged scheduler is still ready until a /health fails."""
    server: SimServer = request.app.state.sim
    if not server.version.has_ready:
        return not_found()
    await _slow_health(server)
    up = server.healthy and not server.faults.starting
    return Response(status_code=200 if up else 503)


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
    if engine.is_eagle:  # lifetime mean, folded every 40 decode batches (internal_state.py)
        state["avg_spec_accept_length"] = engine.lifetime_accept_length()
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
        **({"speculative_adaptive": engine.adaptive is not None}
           if server.version.has_adaptive_speculation else {}),
        "random_seed": s.seed,
    }


async def server_info(request: Request) -> Response:
    server: SimServer = request.app.state.sim
    return json_response({**server_args(server), "max_total_num_tokens":
                          server.engine.limits.kv_capacity_tokens,
                          "internal_states": [_internal_state(server)],
                          "version": server.version.name})


async def get_load(request: Request) -> Response:
    """Up to 0.5.10 (http_server.py 0.5.10:621-628), live; gone in 0.5.23."""
    server: SimServer = request.app.state.sim
    if not server.version.has_get_load:
        return not_found()
    engine = server.engine
    waiting = engine.num_waiting_as_sglang()
    return json_response([{"dp_rank": 0, "num_reqs": len(engine.running) + waiting,
                           "num_waiting_reqs": waiting, "num_tokens": engine.used_tokens()}])


async def v1_loads(request: Request) -> Response:
    """GET /v1/loads?include=core,spec,...&dp_rank=N (loads.py)."""
    server: SimServer = request.app.state.sim
    try:
        body = loads.render(server.engine, server.version, request.query_params.get("include"),
                            request.query_params.get("dp_rank"),
                            reader_attached=not server.faults.loads_reader_detached)
    except loads.LoadsError as exc:
        if exc.status == 500:
            return Response("Internal Server Error", status_code=500, media_type="text/plain")
        err_type = protocol.VALIDATION_ERROR if "dp_rank" in str(exc) else str(exc.status)
        return error_response(str(exc), err_type, exc.status)
    return json_response(body)


async def abort_request(request: Request) -> Response:
    """POST /abort_request {"rid": ..., "abort_all": false}: the abort goes to the scheduler at
    once; 200 with an empty body whether or not the rid is in flight (http_server.py
    0.5.23:1721-1731)."""
    server: SimServer = request.app.state.sim
    try:
        body = await _read_json(request)
    except protocol.BadRequest as exc:
        return error_response(str(exc), protocol.VALIDATION_ERROR)
    if not isinstance(body, dict):
        return error_response("Input should be a valid dictionary", protocol.VALIDATION_ERROR)
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        return error_response("rid must be a string and abort_all a boolean",
                              protocol.VALIDATION_ERROR)
    if abort_all:
        server.engine.abort_all()
    elif rid:
        server.engine.abort_rid(rid)
    return Response(status_code=200)


async def flush_cache(request: Request) -> Response:
    """/flush_cache (http_server.py 0.5.23:1025-1040): an idle engine empties its prefix
    cache and resets its metrics; a busy one answers 400 and flushes nothing."""
    server: SimServer = request.app.state.sim
    if not server.engine.flush_cache():
        return Response("Flush cache failed.\n", status_code=400, media_type="text/plain")
    return Response("Cache flushed.\nPlease check backend logs for more details. "
                    "(When there are running or waiting requests, the operation will not "
                    "be performed.)\n", status_code=200, media_type="text/plain")


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
    if "wedged" in fields:
        server.engine.set_wedged(server.faults.wedged)
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
        "prefill_tokens": c.prefill_tokens, "cached_tokens": c.cached_tokens,
        "cache_tokens": engine.cache.total_tokens,
        "cache_evicted_tokens": engine.cache.evicted_tokens,
        "cache_hit_rate": engine.cache_hit_rate,
        "prefill_steps": c.prefill_steps, "busy_sim_s": c.busy_sim_s,
        "gpu_busy_sim_s": engine.gpu.busy_sim_s, "sim_now": engine.clock.sim_now(),
        "time_scale": engine.clock.time_scale, "dropped_real_s": c.dropped_real_s,
        "max_late_real_s": c.max_late_real_s, "used_tokens": engine.used_tokens(),
        "accept_length": engine.accept_length() if engine.is_eagle else None,
        "observed_accept_length": engine.observed_accept_length() if engine.is_eagle else None,
        "lifetime_accept_length": engine.lifetime_accept_length() if engine.is_eagle else None,
        "window_accept_length": engine.gauges.window_accept_length if engine.is_eagle
        else None,
        "loads_published": engine.publishes, "healthy": server.healthy,
        "sglang_version": server.version.name,
        "max_running_requests": engine.limits.max_running_requests,
        "kv_capacity_tokens": engine.limits.kv_capacity_tokens,
        "profile": engine.profile.name, "faults": server.faults.as_dict(),
        "adaptive_steps": ({str(low): slot.current for low, slot in engine.adaptive.slots.items()}
                           if engine.adaptive is not None else None),
    }


async def sim_state_route(request: Request) -> Response:
    return json_response(sim_state(request.app.state.sim))


async def sim_residence(request: Request) -> Response:
    """GET /sim/residence: each request id's stays in this engine (`sim/residence.py`)."""
    server: SimServer = request.app.state.sim
    return json_response(server.residences.as_json())


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
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/sim/control", sim_control, methods=["POST"]),
        Route("/sim/state", sim_state_route, methods=["GET"]),
        Route("/sim/residence", sim_residence, methods=["GET"]),
    ]

    async def missing(request: Request, exc: Exception) -> Response:
        return not_found()

    app = Starlette(routes=routes, exception_handlers={404: missing})
    app.state.sim = server
    return ApiKeyMiddleware(app, server.settings.api_key)


