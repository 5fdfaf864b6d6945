"""Forwarding: `Proxy` reads a request, a `RequestCycle` carries it to a backend and back.

Lifecycle of one proxied request:
  read body (413 over the limit, 408 too slow) -> peek (400 if not JSON) ->
  router.settle -> router.choose -> router.acquire -> upstream.open -> relay ->
  router.release (always, in `finally`).
A stream's response head waits for its first upstream chunk (SGLang sends its own head
only with the first output, so both leave together). A connection failure, a retryable
status, or a stream whose first event is an error with a retryable status (SGLang's
queue-full answer, `first_event`) is tried once more on another backend, before any
byte reached the client. A recall (`Target.recall`) before the first chunk closes the
upstream request and routes the request again; after it, the same event hands the
stream over to the next target as a continuation (`handover`). While the cycle runs, a
disconnect of the client cancels it.

Each generation attempt carries an SGLang `rid`; an attempt left before its backend
finished it (recalled, client gone, backend silent) is aborted by that rid and counts in
flight until the backend dropped it (`abort`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Any

from starlette.types import Receive, Scope, Send

from specrouter.config import Settings
from specrouter.errors import RouterError, openai_error_body, sse_error_event
from specrouter.proxy.abort import Abandoner, abort_headers, client_rids, new_rid, rid_field
from specrouter.proxy.first_event import event_status, first_chunk
from specrouter.proxy.handover import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Continuation,
    Restamp,
    boundary,
    continuable,
    continuation,
    parse_body,
    read_sent,
)
from specrouter.proxy.recall import Recalled, unless_recalled
from specrouter.proxy.request import (
    BODY_COMPLETE,
    BODY_HELD,
    REQUEST_ID,
    BodyBudget,
    BodyComplete,
    ClientGone,
    RequestHead,
    RouteKind,
    parse_head,
    path_and_query,
    read_body,
    request_id_of,
    request_info,
    with_first_fields,
)
from specrouter.proxy.response import (
    CHUNK_WRITER,
    DISCONNECT_WATCH,
    DisconnectWatch,
    StreamRelay,
    ended_with_done,
    is_event_stream,
    read_whole,
    reported_cache,
    reported_completion_tokens,
    response_headers,
    send_json,
    stream_error_trailer,
    target_headers,
)
from specrouter.proxy.shadow import ShadowProber, probe_body
from specrouter.proxy.upstream import (
    ChunkWriter,
    RawHeaders,
    RequestBody,
    Upstream,
    UpstreamError,
    UpstreamLocalError,
    UpstreamOverLimit,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from specrouter.proxy.usage import USAGE_FIELD, asks_usage
from specrouter.routing.arrivals import Arrival
from specrouter.routing.router import (
    NoBackendAvailable,
    Probe,
    RecallEvent,
    RequestInfo,
    Router,
    Target,
)

log = logging.getLogger("specrouter.proxy")


class _HandOver(Exception):
    """The stream's group switched to the baseline: continue it elsewhere."""

    def __init__(self, handed: Continuation) -> None:
        super().__init__("handed over")
        self.handed = handed


class Retry(Exception):
    """This attempt failed before the first byte: try another backend."""

    def __init__(self, status: int, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.unreachable = unreachable  # the backend never took the connection


#: The scope extension under which the callback path (`proxy.fastpath`) hands this path a
#: request it began, before any byte of it reached the client: a `Resume`.
RESUME = "specrouter.resume"


def settle_resumed(scope: Scope) -> None:
    """As a request's app task ends: give back the target the callback path acquired
    for it if no attempt took it over (`Owed.settle`)."""
    resume = (scope.get("extensions") or {}).get(RESUME)
    if resume is not None and resume.owed is not None:
        resume.owed.settle()


@dataclass(slots=True)
class Owed:
    """A target the callback path acquired as it chose it, handed on with its request:
    counted in flight at once, so that the requests deciding before this one reaches
    the coroutine path see it. That path's attempt takes it over (`take`); a request
    that ends before its attempt gives it back (`settle`): released exactly once."""

    target: Target
    release: Callable[[Target], None]
    taken: bool = False

    def take(self) -> None:
        self.taken = True

    def settle(self) -> None:
        if not self.taken:
            self.taken = True
            self.release(self.target)


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a request the callback path began goes on: its arrival is recorded
    (`arrival`: the quiet window still to wait for, if any) and, as far as it got, the
    target it chose and acquired (`owed`), the backends it tried with the failure that
    made it retry, or its recall."""

    arrival: Arrival | None = None
    owed: Owed | None = None
    tried: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()
    failed: Retry | None = None
    recalled: bool = False


@dataclass(slots=True)
class Attempt:
    """One try of a request on one backend. `settled`: the backend no longer holds the
    request (it answered in full, refused it, or never got it)."""

    target: Target
    headers: RawHeaders
    body: RequestBody
    rids: tuple[str, ...]
    settled: bool = False
    # the router cut the exchange at one of its own limits (`limits.max_stream_duration_s`):
    # an outcome that says nothing about the backend
    cut_by_router: bool = False


class Proxy:
    """Forwards requests to the backend the router chooses; shared by all requests."""

    def __init__(
        self, settings: Settings, router: Router, upstreams: Mapping[str, Upstream]
    ) -> None:
        self.router = router
        self.upstreams = upstreams
        self.max_body = settings.limits.max_body_bytes
        self.bodies = BodyBudget(settings.limits.max_inflight_body_bytes)
        self.max_response_body = settings.limits.max_response_body_bytes
        self.body_timeout = settings.limits.body_timeout_s
        self.total_timeout = settings.timeouts.total
        self.retry = settings.retry.enabled
        self.retry_statuses = frozenset(settings.retry.retry_statuses)
        # a stream's first event with one of these statuses is retried like the status
        self.event_retry_statuses = self.retry_statuses | {503}
        self.set_rid = settings.upstream.abort_abandoned
        self.handover_max_tokens = settings.admission.handover_max_tokens
        # a chat event carries one verify step's tokens in ~150 bytes of JSON: a stream
        # this long has sent more tokens than a handover budget holds
        self.handover_record_bytes = self.handover_max_tokens * 64
        # a prompt's tokens where affinity estimated none (affinity off)
        self.bytes_per_token = settings.affinity.bytes_per_token
        self.affinity = settings.affinity if settings.affinity.enabled else None
        self.prober = ShadowProber(router, upstreams, settings.timeouts.total)
        self.abandoner = Abandoner(router, upstreams, abort=settings.upstream.abort_abandoned,
                                   hold_s=settings.upstream.abandoned_hold_s)

    async def aclose(self) -> None:
        """End the background work: probes, and the waits of abandoned attempts (which
        releases them)."""
        await self.prober.aclose()
        await self.abandoner.aclose()

    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: RouteKind) -> None:
        extensions = scope.get("extensions") or {}
        held: int = extensions.get(BODY_HELD, 0)  # taken by the callback path, ours now
        body: RequestBody | None = None
        try:  # the body's bytes stay taken from the budget until the request ends
            try:
                head = parse_head(scope)
                body = await self._read_body(scope, receive, head, held)
            except RouterError as err:
                await send_json(send, err.status, err.body(),
                                [(REQUEST_ID, request_id_of(scope)), *err.headers])
                return
            except ClientGone:
                return
            except TimeoutError:
                late = RouterError(408, f"request body not received within "
                                        f"{self.body_timeout:g} s")
                await send_json(send, late.status, late.body(),
                                [(REQUEST_ID, request_id_of(scope)), (b"connection", b"close")])
                return
            try:
                info = request_info(kind, scope["path"], body, head, self.affinity)
            except RouterError as err:
                await send_json(send, err.status, err.body(), [(REQUEST_ID, head.request_id)])
                return
            await RequestCycle(self, scope, send, head, body, info,
                               kind is RouteKind.GENERATE).run(receive, extensions.get(RESUME))
        finally:
            self.bodies.give_back(held if body is None else len(body))

    async def _read_body(self, scope: Scope, receive: Receive, head: RequestHead,
                         held: int) -> RequestBody:
        """The request's body. A client trickling it must not hold the request (and its
        memory) forever: the read is bounded by `limits.body_timeout_s`, unless the server
        says the whole body is in (`BODY_COMPLETE`) and the read cannot wait. With `held`
        bytes already taken from the budget for it, the read takes none."""
        read = read_body(receive, head.content_length, self.max_body,
                         None if held else self.bodies)
        extensions = scope.get("extensions")
        complete: BodyComplete | None = (None if extensions is None
                                         else extensions.get(BODY_COMPLETE))
        if complete is not None and complete():
            return await read
        async with asyncio.timeout(self.body_timeout):
            return await read


class RequestCycle:
    """One proxied request, from the router's first `choose` to the last byte sent.

    `finished` is set just before the final response message goes out: from then on a
    client disconnect no longer cancels the cycle. `client_gone` says the watcher did.
    `client_rids` are the rids the client set in a generation body (None: it set none).
    `handed` restamps the events of a continuation once the stream was handed over.
    `relay` is what the stream being relayed sent so far (None before one starts).
    `usage_asked`: the proxy asks the engine for the stream's usage event and drops it
    before the client (`proxy/usage.py`), where affinity is on (its retention reads it).
    """

    __slots__ = ("answer", "body", "client_gone", "client_rids", "disconnect_watch",
                 "finished", "first_at", "generation", "handed", "head", "info", "method", "path",
                 "proxy", "relay", "router", "send", "task", "usage_asked", "writer")

    def __init__(self, proxy: Proxy, scope: Scope, send: Send, head: RequestHead,
                 body: RequestBody, info: RequestInfo, generation: bool = False) -> None:
        self.proxy = proxy
        self.router = proxy.router
        self.send = send
        extensions = scope.get("extensions")
        self.writer: ChunkWriter | None = None
        self.disconnect_watch: DisconnectWatch | None = None
        if extensions is not None:
            self.writer = extensions.get(CHUNK_WRITER)
            self.disconnect_watch = extensions.get(DISCONNECT_WATCH)
        self.task: asyncio.Task[Any] | None = None
        self.head = head
        self.body = body
        self.info = info
        self.method: str = scope["method"]
        self.path = path_and_query(scope)
        self.client_gone = False
        self.finished = False
        self.generation = generation
        self.client_rids = client_rids(body) if generation else None
        self.usage_asked = (generation and proxy.affinity is not None
                            and asks_usage(info.path, info.stream, body))
        self.handed: Restamp | None = None
        self.relay: StreamRelay | None = None
        self.answer = b""  # a non-stream answer's body, read for its usage
        self.first_at: float | None = None  # when a stream's first chunk came (monotonic)

    async def run(self, receive: Receive, resume: Resume | None = None) -> None:
        """Carry the request to a backend and back; from where `resume` says the callback
        path left it, if it began it."""
        self.task = task = asyncio.current_task()
        assert task is not None
        watch = self.disconnect_watch
        watcher: asyncio.Task[None] | None = None
        if watch is not None:
            watch(self._client_left)
        else:
            watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive))
        try:
            await self._forward(resume)
        except asyncio.CancelledError:
            # We cancelled ourselves because the client left: the upstream is already
            # closed by the `finally` blocks below; nothing more to answer.
            if self.client_gone and task.uncancel() == 0:
                return
            raise
        finally:
            self.finished = True
            if watcher is not None:
                watcher.cancel()
            elif watch is not None:
                watch(None)

    def _client_left(self) -> None:
        """Cancel the request's task the moment the client goes away. Nothing is cancelled
        once it finished (the last message is on its way) nor once the client got the
        stream's `[DONE]`: it had the whole answer (the OpenAI client closes at `[DONE]`,
        before the upstream's end of body), so the cycle ends as answered."""
        if self.finished or self.task is None:
            return
        if self.relay is not None and ended_with_done(self.relay.tail):
            return
        self.client_gone = True
        self.task.cancel()

    async def _watch_disconnect(self, receive: Receive) -> None:
        """Without the server's disconnect watch: wait in `receive` for the client to go."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._client_left()
                return

    async def _forward(self, resume: Resume | None) -> None:
        """Choose, attempt, and on a retryable failure or a recall choose again."""
        tried: frozenset[str] = frozenset()
        exclude: frozenset[str] = frozenset()
        failed: Retry | None = None
        chosen: Target | None = None
        owed: Owed | None = None  # chosen, and acquired by the callback path
        if resume is None:
            burst_ahead = await self.router.settle(self.info)
        else:
            arrival = resume.arrival
            burst_ahead = 0 if arrival is None else await self.router.wait(arrival)
            tried, exclude, failed = resume.tried, resume.exclude, resume.failed
            if resume.owed is not None:
                owed, chosen = resume.owed, resume.owed.target
            if resume.recalled:
                self.info = replace(self.info, recalled=True)
        if burst_ahead:
            self.info = replace(self.info, burst_ahead=burst_ahead)
        while True:
            target = chosen
            chosen = None
            if target is None:
                target = await self._choose(exclude, failed)
                if target is None:
                    return
                if target.probe is not None:
                    self.send_probe(target.probe)
            may_retry = self.proxy.retry and not tried and self.handed is None
            attempt = self.prepare(target)
            if owed is not None and owed.target is target:
                owed.take()  # released by this attempt from here on, as any is
            else:
                self.router.acquire(target)
            owed = None
            try:
                await self._attempt(attempt, may_retry)
                return
            except Retry as retry:
                tried, failed = tried | {target.backend.name}, retry
                exclude = self.retry_exclude(tried, target, retry.unreachable)
                log.info("request %s: retrying after %s", self.head.request_id.decode(),
                         retry.message)
            except Recalled:
                self.info = replace(self.info, recalled=True)
                log.info("request %s: recalled from %s before its first byte",
                         self.head.request_id.decode(), target.backend.name)
            except _HandOver as move:
                self.hand_over(move.handed, target)
            finally:
                self.leave(attempt)

    async def _choose(self, exclude: frozenset[str], failed: Retry | None) -> Target | None:
        """The router's choice, or None once the client got the router's refusal."""
        try:
            return self.router.choose(
                replace(self.info, exclude=exclude) if exclude else self.info)
        except NoBackendAvailable as exc:
            err = (RouterError(503, str(exc), code="no_backend") if failed is None
                   else RouterError(failed.status, failed.message))
        except RouterError as refused:  # the router refused the request (e.g. a bad header)
            err = refused
        await self._refuse(err)
        return None

    def hand_over(self, handed: Continuation, target: Target) -> None:
        """The stream goes on elsewhere as `handed`, its events restamped as this one's."""
        self.body, self.handed = handed.body, Restamp(handed)
        self.info = replace(self.info, recalled=True, handed_over=True)
        log.info("request %s: handed over from %s after %d events",
                 self.head.request_id.decode(), target.backend.name, handed.sent.events)

    def prepare(self, target: Target) -> Attempt:
        """The attempt's headers and body: a generation gets a fresh rid unless the
        client set its own, and the request for its usage event (`usage_asked`)."""
        headers = self.head.upstream_headers(target.backend)
        fields = [USAGE_FIELD] if self.usage_asked else []
        rids: tuple[str, ...] = ()
        if self.generation and self.proxy.set_rid:
            if self.client_rids is not None:
                rids = self.client_rids
            else:
                rid = new_rid(self.head.request_id)
                rids = (rid,)
                fields.append(rid_field(rid))
        body = with_first_fields(self.body, b",".join(fields)) if fields else self.body
        return Attempt(target, headers, body, rids)

    def leave(self, attempt: Attempt) -> None:
        """Release the attempt's backend: now, or once it dropped an unfinished
        generation (`Abandoner`)."""
        if attempt.settled or not self.generation:
            self.router.release(attempt.target)
        else:
            self.proxy.abandoner.abandon(attempt.target, attempt.rids,
                                         abort_headers(attempt.headers))

    def send_probe(self, probe: Probe) -> None:
        shadow = probe_body(self.path, self.body, probe.max_tokens)
        if shadow is None:
            return
        # Its own request id, so the engine's logs never mix it up with the client's.
        headers = self.head.upstream_headers(probe.target.backend,
                                             self.head.request_id + b"-probe")
        self.proxy.prober.send(probe.target, self.path, headers, shadow)

    async def _attempt(self, attempt: Attempt, may_retry: bool) -> None:
        target = attempt.target
        name = target.backend.name
        upstream = self.proxy.upstreams[name]
        try:
            response = await unless_recalled(upstream.open(
                self.method, self.path, attempt.headers, attempt.body, stream=self.info.stream,
            ), target.recall)
        except UpstreamLocalError as exc:
            attempt.settled = True  # the router's own failure: the backend is not blamed
            await self._refuse(RouterError(
                503, f"the router is out of local resources: {exc}", code="overloaded",
                retry_after_s=1))
            return
        except UpstreamUnreachable as exc:
            attempt.settled = True  # the backend never took the request
            self.router.record_outcome(name, False, str(exc))
            message = f"backend {name} unreachable: {exc}"
            if may_retry and self.has_alternative(target):
                raise Retry(502, message, unreachable=True) from exc
            await self._fail(target, 502, message)
            return
        except UpstreamTimeout as exc:
            self.router.record_outcome(name, False, str(exc))
            await self._fail(target, 504, f"backend {name} timed out: {exc}")
            return
        except UpstreamError as exc:
            self.router.record_outcome(name, False, str(exc))
            await self._fail(target, 502, f"backend {name} failed: {exc}")
            return
        try:
            status = response.status
            if (status in self.proxy.retry_statuses and may_retry
                    and self.has_alternative(target)):
                attempt.settled = True
                self.router.record_outcome(name, False, f"HTTP {status}")
                raise Retry(status, f"backend {name} answered HTTP {status}")
            if self.handed is not None:
                error = await self._relay_continuation(response, attempt, self.handed)
            elif is_event_stream(response.headers):
                error = await self._relay_stream(response, attempt, may_retry)
            else:
                error = await self._relay_buffered(response, target)
                attempt.settled = error is None
            if error is None and status >= 500:
                error = f"HTTP {status}"
            if error is None and self.generation and status < 300:
                self.observe_answer(target)
            if not attempt.cut_by_router:
                self.router.record_outcome(name, error is None, error)
        finally:
            await response.aclose()

    def observe_answer(self, target: Target) -> None:
        """Tell the router what the engine reported it had cached of this request and, for
        a stream one engine answered whole, its time per output token after the first
        (first chunk to end). A continuation's usage counts its own tokens while its
        time runs from the first engine's first chunk: no pace is read from it."""
        data = self.answer or (self.relay.tail if self.relay is not None else b"")
        seen = reported_cache(data)
        if seen is not None:
            self.router.observe_cached(target, *seen)
        if self.first_at is not None and self.handed is None:
            tokens = reported_completion_tokens(data)
            if tokens is not None and tokens > 1:
                took_ms = (time.monotonic() - self.first_at) * 1000.0
                self.router.observe_pace(target, took_ms / (tokens - 1))

    def retry_exclude(self, tried: frozenset[str], failed: Target,
                       unreachable: bool) -> frozenset[str]:
        """What the retry's choice excludes: the backends tried and, after a backend that
        could not be reached, its whole GPU group while another group has a healthy
        server. Both servers of a group share a host: when it dies, a retry on the
        sibling fails too and the client gets the error although another group is up."""
        if not unreachable:
            return tried
        avoid = tried | {b.name for b in self.router.backends if b.group == failed.group}
        return avoid if self._healthy_outside(avoid) else tried

    def has_alternative(self, target: Target) -> bool:
        """Whether a retry could land anywhere: without one, answer the first failure."""
        return self._healthy_outside({target.backend.name})

    def _healthy_outside(self, names: AbstractSet[str]) -> bool:
        """Whether a healthy backend outside `names` exists."""
        return any(b.name not in names and self.router.healthy(b.name)
                   for b in self.router.backends)

    async def _refuse(self, err: RouterError) -> None:
        self.finished = True
        if self.handed is not None:
            log.warning("request %s: %s", self.head.request_id.decode(), err.message)
            await self._end_handed(err.message, err.status)
            return
        await send_json(self.send, err.status, err.body(),
                        [(REQUEST_ID, self.head.request_id), *err.headers])

    async def _fail(self, target: Target, status: int, message: str) -> None:
        log.warning("request %s: %s", self.head.request_id.decode(), message)
        self.finished = True
        if self.handed is not None:
            await self._end_handed(message, status)
            return
        body = openai_error_body(status, message)
        await send_json(self.send, status, body, target_headers(target, self.head.request_id))

    async def _relay_stream(self, response: UpstreamResponse, attempt: Attempt,
                            may_retry: bool) -> str | None:
        """Pass SSE chunks through as they arrive; end a broken stream with an error event.
        Returns what went wrong upstream, if anything. The response head leaves with the
        first chunk; before it, a recall raises Recalled and, while a retry is possible, a
        first event with a retryable status raises Retry; after it, a recall raises
        _HandOver once the client got a whole event (`_hand_over_at`). After the first
        chunk the body is diverted to the client's chunk writer when the server offers one
        (`CHUNK_WRITER`): chunks then go from the upstream's socket to the client's with
        no ASGI message and no task switch; whatever the writer refuses comes back
        through `iter_raw` and `send`, which waits for the client to drain."""
        target = attempt.target
        headers = response_headers(response.headers, target, self.head.request_id)
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        send = self.send
        started = False
        handover = self.may_hand_over(target)
        relay = self.relay = StreamRelay(
            self.writer, self.proxy.handover_record_bytes if handover else 0,
            without_usage=self.usage_asked)
        direct = self.writer is not None
        failure: UpstreamError | None = None
        try:
            chunks = response.iter_raw()
            first = await unless_recalled(first_chunk(chunks), target.recall)
            if first is not None:
                self.first_at = time.monotonic()
                if may_retry:
                    self.check_first_event(first, attempt)
                await send(start)
                started = True
                await self._send_part(relay, first)
                if handover and target.recall is not None:
                    hold_on(target.recall, relay)
                direct = direct and response.divert(relay.write)
                async for chunk in chunks:
                    if chunk and relay.holding:
                        chunk = await self._hand_over_at(relay, chunk, target)
                    if chunk:
                        await self._send_part(relay, chunk)
                        if direct:
                            response.divert(relay.write)
        except UpstreamError as exc:
            failure = exc
        error, trailer = self.stream_outcome(attempt, relay, failure)
        if not started:
            await send(start)
        await send({"type": "http.response.body", "body": relay.rest_for_client() + trailer,
                    "more_body": False})
        return error

    def stream_outcome(self, attempt: Attempt, relay: StreamRelay,
                        failure: UpstreamError | None) -> tuple[str | None, bytes]:
        """What went wrong with a relayed stream (None: it ended with [DONE]) and the
        bytes that end it for the client: nothing, or an error event."""
        code = 502
        if isinstance(failure, UpstreamTimeout):
            error: str | None = f"backend went silent: {failure}"
            code = 504
        elif isinstance(failure, UpstreamOverLimit):
            attempt.cut_by_router = True
            error = f"stream stopped by the router: {failure}"
        elif failure is not None:
            error = f"backend stream failed: {failure}"
        else:
            attempt.settled = True
            error = None if ended_with_done(relay.tail) else (
                "backend closed the stream before [DONE]")
        self.finished = True
        if error is None:
            return None, b""
        return error, stream_error_trailer(attempt.target, relay.tail, error, code)

    def may_hand_over(self, target: Target) -> bool:
        """Whether this stream may be handed over after its first byte: a stream the
        router may recall, of a route a continuation exists for."""
        return (target.recall is not None and self.proxy.handover_max_tokens > 0
                and self.info.path in (CHAT_PATH, COMPLETIONS_PATH))

    async def _hand_over_at(self, relay: StreamRelay, chunk: bytes, target: Target) -> bytes:
        """The group switched (`relay.holding`): once the client's bytes end on an event
        boundary, raise _HandOver if the stream can be continued elsewhere; else stop
        holding. Returns what of `chunk` is still to be sent."""
        if not relay.at_boundary:
            cut = boundary(chunk)
            if cut == 0:
                return chunk  # the event goes on in the next chunk
            await self._send_part(relay, chunk[:cut])
            chunk = chunk[cut:]
        handed = self.handed_continuation(relay, target)
        if handed is not None:
            raise _HandOver(handed)
        relay.holding, relay.record = False, None
        return chunk

    def handed_continuation(self, relay: StreamRelay, target: Target) -> Continuation | None:
        """The continuation of this stream after what the client got, if the request
        allows one and its context fits in what is left of the switch's handover budget
        (the streams that reach their next event first take it)."""
        body = parse_body(self.body)
        path = self.info.path
        if body is None or relay.record is None or not continuable(path, body):
            return None
        sent = read_sent(b"".join(relay.record), path == CHAT_PATH)
        if sent is None:
            return None
        handed = continuation(path, body, sent, target.accept_length)
        if handed is None:
            return None
        prompt = (self.info.prefix.prompt_tokens if self.info.prefix is not None
                  else len(self.body) / self.proxy.bytes_per_token)
        budget = target.recall.budget if target.recall is not None else None
        return handed if budget is not None and budget.take(prompt + handed.tokens_sent) else None

    async def _relay_continuation(self, response: UpstreamResponse, attempt: Attempt,
                                  restamp: Restamp) -> str | None:
        """Relay a handed-over stream's continuation after the bytes the client already
        got: its events restamped as the first stream's, its failure as an error event."""
        target = attempt.target
        if response.status != 200 or not is_event_stream(response.headers):
            attempt.settled = True
            refused = f"the continuation answered HTTP {response.status}"
            await self._fail(target, 502, f"backend {target.backend.name}: {refused}")
            return refused if response.status >= 500 else None
        relay = self.relay = StreamRelay(None, tail=b"\n\n", without_usage=self.usage_asked)
        failure: UpstreamError | None = None
        try:
            async for chunk in response.iter_raw():
                await self._send_part(relay, restamp.feed(chunk))
            await self._send_part(relay, restamp.flush())
        except UpstreamError as exc:
            failure = exc
        error, trailer = self.stream_outcome(attempt, relay, failure)
        await self.send({"type": "http.response.body", "body": relay.rest_for_client() + trailer,
                         "more_body": False})
        return error

    async def _send_part(self, relay: StreamRelay, data: bytes) -> None:
        """Send the stream's next bytes `data` (if any, and as much of them as the client
        gets: `StreamRelay.for_client`) as a part of the body that more parts follow."""
        if data:
            out = relay.for_client(data)
            if out:
                await self.send({"type": "http.response.body", "body": out, "more_body": True})
            relay.sent(data)

    async def _end_handed(self, message: str, status: int) -> None:
        """End a handed-over stream whose continuation could not start: the client's
        head and first events are out, so the failure is an error event."""
        await self.send({"type": "http.response.body",
                         "body": sse_error_event(message, code=status), "more_body": False})

    def check_first_event(self, first: bytes, attempt: Attempt) -> None:
        """Raise Retry when the stream opens with an error event whose status is
        retryable (SGLang's full queue) and another backend could take the request."""
        status = event_status(first)
        target = attempt.target
        if status not in self.proxy.event_retry_statuses or not self.has_alternative(target):
            return
        attempt.settled = True  # SGLang ended the request with that event
        name = target.backend.name
        self.router.record_outcome(name, False, f"stream error event {status}")
        raise Retry(status, f"backend {name} answered a stream with error {status}")

    async def _relay_buffered(self, response: UpstreamResponse, target: Target) -> str | None:
        """A non-SSE body: read it whole (bounded by `total` and by
        `limits.max_response_body_bytes`), so a failure while reading can still be
        answered with a proper status instead of a truncated body."""
        name = target.backend.name
        try:
            async with asyncio.timeout(self.proxy.total_timeout):
                body = await read_whole(response, self.proxy.max_response_body)
        except (UpstreamTimeout, TimeoutError) as exc:
            message = f"backend {name} timed out: {exc or 'total timeout'}"
            await self._fail(target, 504, message)
            return message
        except UpstreamError as exc:
            message = f"backend {name} failed: {exc}"
            await self._fail(target, 502, message)
            return message
        headers = response_headers(response.headers, target, self.head.request_id, len(body))
        self.finished = True
        self.answer = body
        await self.send({"type": "http.response.start", "status": response.status,
                         "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
        return None


def hold_on(recall: RecallEvent, relay: StreamRelay) -> None:
    """Make `relay` hold its next chunk once `recall` is set (now, if it is)."""
    if recall.is_set():
        relay.hold()
    else:
        recall.on_set(relay.hold)
