"""The callback path: a generation request whose body is in, carried to a backend and back
on the two connections' callbacks, with no task, no awaitable exchange and no ASGI message.

The server offers it the request once the body is in (`FastPath.take`, from the edge's
protocol). From there the request runs as a state machine on callbacks:

  arrive -> choose -> acquire -> upstream write (an idle keep-alive connection)
  -> upstream head -> first event -> the client's head and every chunk, written as read
  -> end -> outcome, release

with the coroutine path's (`proxy.forward.RequestCycle`) own steps and answers: the same
`RequestCycle` object prepares the attempt, reads the first event, builds the outcome and
leaves the backend, so both paths give a client the same bytes. Whatever needs a wait is
handed to the coroutine path, which goes on from where this one stopped (`Resume`):
before any byte reached the client, a request that should wait for the arrival window,
finds no idle connection, is to be retried elsewhere, or is recalled, is served by the
ASGI app from the start (`ClientSide.fall_back`); after it, a stream handed over to the
other pool goes on in a task that relays the continuation through the server's `send`.

Flow control: while the client's buffer is over its high-water mark, the backend's
connection is not read (`pause`, `resume`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

from starlette.types import Receive, Scope, Send

from specrouter.errors import JSON_HEADERS, RouterError, openai_error_body
from specrouter.proxy.first_event import first_event_complete
from specrouter.proxy.forward import Attempt, Owed, Proxy, RequestCycle, Resume, Retry
from specrouter.proxy.handover import boundary
from specrouter.proxy.request import RouteKind, parse_head, request_info
from specrouter.proxy.response import (
    StreamRelay,
    declared_over_limit,
    ended_with_done,
    is_event_stream,
    response_headers,
    target_headers,
)
from specrouter.proxy.upstream import (
    CallbackUpstream,
    Exchange,
    RawHeaders,
    RequestBody,
    UpstreamError,
    UpstreamOverLimit,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from specrouter.routing.router import NoBackendAvailable, Target

log = logging.getLogger("specrouter.proxy")



class CallbackMetrics(Protocol):
    """What the callback path reports (`RouterMetrics` is one)."""

    def observe_request(self, pool: str, backend: str, status: int, ttft_s: float | None,
                        e2e_s: float) -> None:
        """A request it served: pool, backend, status, time to the first body byte of a
        stream, total."""

    def observe_fallback(self, reason: str) -> None:
        """A request it handed to the app (`Fallback`)."""


class Fallback(enum.Enum):
    """Why a request goes on on the coroutine path (the `reason` label)."""

    APP = "app"  # draining, a body over the limit or not JSON: the app answers
    ARRIVAL_WINDOW = "arrival_window"
    NO_BACKEND = "no_backend"  # the router's choice failed: the app answers
    NOT_STARTED = "not_started"  # no idle connection, a large body, the body budget
    STALE_CONNECTION = "stale_connection"
    RETRY = "retry"
    RECALL = "recall"
    HANDOVER = "handover"  # after the first byte: the continuation's task
    ERROR = "error"  # a bug on the callback path before the exchange started


class ClientSide(Protocol):
    """The client's connection as the server offers it to the callback path."""

    scope: Scope
    body: RequestBody
    send: Send  # the server's ASGI `send` and `receive` for this request
    receive: Receive
    # bytes of the body taken from the proxy's body budget for this request: given back
    # when the request ends here, handed on with it to the app (`BODY_HELD`)
    held: int

    def respond(self, status: int, headers: RawHeaders, chunked: bool, body: bytes = b"",
                end: bool = False) -> None:
        """Write the response head as the server's `send` would (its own headers too) and,
        in the same write, `body` (a chunk of a chunked response, else the whole body);
        with `end` the response is complete."""

    def write_chunk(self, data: bytes) -> bool:
        """Write one chunk of the chunked response; always True (for `StreamRelay`)."""

    def end_response(self, last: bytes) -> None:
        """Write the last chunk of the chunked response (if any) and end it; the
        connection then serves its next request, or closes."""

    def fall_back(self, resume: Resume | None) -> None:
        """Serve the request on the coroutine path (the ASGI app), from `resume`, with
        the body's `held` budget."""

    def abort(self) -> None:
        """Close the connection: a response cut short."""

    def finished(self) -> None:
        """The callback path is done with this request."""


class _Stage(enum.Enum):
    HEAD = "head"  # the upstream's response head is awaited
    FIRST = "first"  # a stream's first event is awaited
    RELAY = "relay"  # the stream is relayed to the client
    BUFFER = "buffer"  # a non-stream answer is read whole
    HANDED = "handed"  # the coroutine path carries on
    DONE = "done"


class FastPath:
    """Shared by the requests of one app: what `take` needs of the app around it."""

    def __init__(self, proxy: Proxy, is_draining: Callable[[], bool],
                 count_active: Callable[[int], None],
                 metrics: CallbackMetrics | None = None) -> None:
        self.proxy = proxy
        self.is_draining = is_draining
        self.count_active = count_active
        self.metrics = metrics
        self.upstreams = {name: upstream for name, upstream in proxy.upstreams.items()
                          if isinstance(upstream, CallbackUpstream)}

    def take(self, client: ClientSide) -> FastExchange | None:
        """Serve the request on callbacks, or hand it to `client.fall_back`. The
        exchange is returned while it runs (the server reports the client's flow control
        and departure to it). A bug before the exchange started gives the request to the
        app as it came."""
        try:
            return self._take(client)
        except Exception:
            log.exception("unhandled error on the callback path: the app serves the request")
            self.fall_back(client, None, Fallback.ERROR)
            return None

    def fall_back(self, client: ClientSide, resume: Resume | None, reason: Fallback) -> None:
        """Hand the request to the app, from `resume`, and count why."""
        if self.metrics is not None:
            self.metrics.observe_fallback(reason.value)
        client.fall_back(resume)

    def _take(self, client: ClientSide) -> FastExchange | None:
        proxy = self.proxy
        body = client.body
        if self.is_draining() or len(body) > proxy.max_body:
            self.fall_back(client, None, Fallback.APP)  # the app answers both
            return None
        if not client.held:  # from here on the request holds its body's budget
            try:
                proxy.bodies.take(len(body))
            except RouterError:
                self.fall_back(client, None, Fallback.APP)  # the app refuses it
                return None
            client.held = len(body)
        scope = client.scope
        try:
            head = parse_head(scope)
            info = request_info(RouteKind.GENERATE, scope["path"], body, head, proxy.affinity)
        except RouterError:
            self.fall_back(client, None, Fallback.APP)
            return None
        cycle = RequestCycle(proxy, scope, client.send, head, body, info, generation=True)
        router = proxy.router
        arrival = router.arrive(info)
        if arrival is not None:
            self.fall_back(client, Resume(arrival=arrival), Fallback.ARRIVAL_WINDOW)
            return None
        try:
            target = router.choose(info)
        except (NoBackendAvailable, RouterError):
            self.fall_back(client, Resume(), Fallback.NO_BACKEND)  # the app answers
            return None
        if target.probe is not None:
            cycle.send_probe(target.probe)
        upstream = self.upstreams.get(target.backend.name)
        attempt = cycle.prepare(target)
        exchange = None if upstream is None else self._start(client, cycle, attempt, upstream)
        if exchange is None:
            # counted now: the requests deciding before the app's task runs see it
            router.acquire(target)
            self.fall_back(client, Resume(owed=Owed(target, router.release)),
                           Fallback.NOT_STARTED)
            return None
        self.count_active(1)
        try:
            router.acquire(target)
            if target.recall is not None:
                target.recall.on_set(exchange.recalled)
        except Exception as exc:  # the request is sent: it ends as a failed exchange
            exchange.on_error(UpstreamError(f"the router failed: {exc}"))
        return exchange

    def _start(self, client: ClientSide, cycle: RequestCycle, attempt: Attempt,
               upstream: CallbackUpstream) -> FastExchange | None:
        """The attempt sent on an idle connection; None (nothing sent) without one."""
        exchange = FastExchange(self, client, cycle, attempt, upstream)
        started = upstream.start(cycle.method, cycle.path, attempt.headers, attempt.body,
                                 exchange, stream=cycle.info.stream)
        if started is None:
            return None
        exchange.upstream_exchange = started
        return exchange


class FastExchange:
    """One request on the callback path, and the listener of its upstream exchange."""

    __slots__ = ("attempt", "client", "cycle", "fast", "first", "parts", "size", "stage",
                 "started_at", "status", "task", "ttft", "upstream", "upstream_exchange",
                 "upstream_headers")

    def __init__(self, fast: FastPath, client: ClientSide, cycle: RequestCycle,
                 attempt: Attempt, upstream: CallbackUpstream) -> None:
        self.fast = fast
        self.client = client
        self.cycle = cycle
        self.attempt = attempt
        self.upstream = upstream
        self.upstream_exchange: Exchange | None = None
        self.stage = _Stage.HEAD
        self.started_at = time.perf_counter()
        self.ttft: float | None = None
        self.status = 0
        self.upstream_headers: RawHeaders = []
        self.first = b""  # a stream's bytes before its first event is whole
        self.parts: list[bytes] = []  # a buffered answer's body
        self.size = 0
        self.task: asyncio.Task[None] | None = None  # the coroutine path's, once handed over

    @property
    def target(self) -> Target:
        return self.attempt.target

    # -- the upstream's callbacks (`proxy.upstream.ExchangeListener`) ---------------------

    def on_head(self, status: int, headers: RawHeaders) -> None:
        try:
            self._head(status, headers)
        except Exception as exc:  # a bug must not leave the request hanging
            self._crash(exc)

    def on_data(self, data: bytes) -> bool:
        """Returns True: the bytes are taken (a transport may call it as its writer)."""
        try:
            if self.stage is _Stage.RELAY:
                relay = self.cycle.relay
                if relay is not None and not relay.write(data):
                    self._hand_over_at(relay, data)  # held: the group switched
                return True
            stage = self.stage
            if stage is _Stage.FIRST:
                self.first += data
                if first_event_complete(self.first):
                    self._first_event()
            elif stage is _Stage.BUFFER:
                self._buffer(data)
        except Exception as exc:
            self._crash(exc)
        return True

    def on_end(self, last: bytes) -> None:
        try:
            stage = self.stage
            if stage is _Stage.RELAY:
                relay = self.cycle.relay
                if relay is not None and relay.holding and last:
                    self.on_data(last)  # a handover may still take the stream
                    last = b""
                if self.stage is _Stage.RELAY:
                    self._end_stream(None, last)
            elif stage is _Stage.FIRST:
                self.first += last
                if not (self.first and self._retried_first()):
                    self._end_stream(None, b"")
            elif stage is _Stage.BUFFER:
                self._buffer(last)
                if self.stage is _Stage.BUFFER:
                    self._end_buffered()
        except Exception as exc:
            self._crash(exc)

    def on_error(self, error: UpstreamError) -> None:
        try:
            stage = self.stage
            if stage is _Stage.HEAD:
                self._head_failed(error)
            elif stage is _Stage.RELAY or stage is _Stage.FIRST:
                self.first = b""  # a first event cut short is not relayed
                self._end_stream(error, b"")
            elif stage is _Stage.BUFFER:
                self._buffer_failed(error)
        except Exception as exc:
            self._crash(exc)

    # -- the client's side, from the server ----------------------------------------------

    def pause(self) -> None:
        """The client's buffer passed its high-water mark: stop reading the backend (while
        this path reads it: after a handover the continuation's task flows by `send`)."""
        if self.upstream_exchange is not None:
            self.upstream_exchange.pause_reading()

    def resume(self) -> None:
        if self.upstream_exchange is not None:
            self.upstream_exchange.resume_reading()

    def client_lost(self) -> None:
        """The client's connection closed. A client that got the stream's `[DONE]` had
        the whole answer: the exchange ends as answered (as on the coroutine path)."""
        if self.stage is _Stage.DONE or self.stage is _Stage.HANDED:
            return
        relay = self.cycle.relay
        if relay is not None and ended_with_done(relay.tail):
            return
        self.cycle.client_gone = True
        self._leave_upstream()
        self._done(499 if self.ttft is not None else None)  # counted once answered

    def recalled(self) -> None:
        """The router recalled the attempt (`Target.recall`): before the client's head
        it is routed again on the coroutine path; after it, a stream that may be handed
        over holds its next chunk (`StreamRelay.hold`)."""
        try:
            if self.stage is _Stage.HEAD or self.stage is _Stage.FIRST:
                cycle = self.cycle
                log.info("request %s: recalled from %s before its first byte",
                         cycle.head.request_id.decode(), self.target.backend.name)
                self._leave_upstream()
                self._fall_back(Resume(recalled=True), Fallback.RECALL)
            elif (self.stage is _Stage.RELAY and self.cycle.relay is not None
                  and self.cycle.may_hand_over(self.target)):
                self.cycle.relay.hold()
        except Exception as exc:
            self._crash(exc)

    # -- the stages ------------------------------------------------------------------------

    def _head(self, status: int, headers: RawHeaders) -> None:
        cycle, target = self.cycle, self.target
        proxy = cycle.proxy
        name = target.backend.name
        if (status in proxy.retry_statuses and self._may_retry()
                and cycle.has_alternative(target)):
            self.attempt.settled = True
            cycle.router.record_outcome(name, False, f"HTTP {status}")
            self._retry(Retry(status, f"backend {name} answered HTTP {status}"))
            return
        self.status, self.upstream_headers = status, headers
        if is_event_stream(headers):
            self.stage = _Stage.FIRST
            return
        self.stage = _Stage.BUFFER
        over = declared_over_limit(headers, proxy.max_response_body)
        if over is not None:
            self._buffer_failed(over)

    def _head_failed(self, error: UpstreamError) -> None:
        cycle, target = self.cycle, self.target
        name = target.backend.name
        if isinstance(error, UpstreamUnreachable):
            # A keep-alive connection the backend closed as it was reused: the request
            # never reached it. The coroutine path tries the target on a fresh one, and
            # it stays counted in flight meanwhile (`Owed`).
            self.attempt.settled = True
            self._close_upstream()
            self._fall_back(Resume(owed=Owed(target, cycle.router.release)),
                            Fallback.STALE_CONNECTION)
            return
        cycle.router.record_outcome(name, False, str(error))
        if isinstance(error, UpstreamTimeout):
            self._fail(504, f"backend {name} timed out: {error}")
        else:
            self._fail(502, f"backend {name} failed: {error}")

    def _first_event(self) -> None:
        """The first event is whole: the client's head leaves with it, in one write."""
        if self._retried_first():
            return
        relay = self._new_relay()
        self._respond(self._for_client(relay, self.first))
        self.first = b""

    def _retried_first(self) -> bool:
        """Whether the stream's first event (`first`) sent the request elsewhere: an
        error event with a retryable status, while a retry is possible."""
        self.cycle.first_at = time.monotonic()
        if self._may_retry():
            try:
                self.cycle.check_first_event(self.first, self.attempt)
            except Retry as retry:
                self._retry(retry)
                return True
        return False

    def _new_relay(self) -> StreamRelay:
        cycle, target = self.cycle, self.target
        handover = cycle.may_hand_over(target)
        self.stage = _Stage.RELAY
        relay = cycle.relay = StreamRelay(
            self.client.write_chunk, cycle.proxy.handover_record_bytes if handover else 0,
            without_usage=cycle.usage_asked)
        return relay

    def _respond(self, body: bytes, end: bool = False) -> None:
        """The stream's head, with its first bytes for the client (and, with `end`, all)."""
        cycle = self.cycle
        self.client.respond(self.status or 200, response_headers(
            self.upstream_headers, self.target, cycle.head.request_id), True, body, end)
        self.ttft = time.perf_counter() - self.started_at

    @staticmethod
    def _for_client(relay: StreamRelay, data: bytes) -> bytes:
        """What the client gets now of the stream's next bytes `data`, which are sent."""
        if not data:
            return b""
        out = relay.for_client(data)
        relay.sent(data)
        return out

    def _send_part(self, relay: StreamRelay, data: bytes) -> None:
        self.client.write_chunk(self._for_client(relay, data))

    def _hand_over_at(self, relay: StreamRelay, chunk: bytes) -> None:
        """The coroutine path's `_hand_over_at`, on callbacks: once the client's bytes
        end on an event boundary, the stream goes on elsewhere if it can be continued;
        else it stops holding."""
        if not relay.at_boundary:
            cut = boundary(chunk)
            if cut == 0:
                self._send_part(relay, chunk)  # the event goes on in the next chunk
                return
            self._send_part(relay, chunk[:cut])
            chunk = chunk[cut:]
        cycle, target = self.cycle, self.target
        handed = cycle.handed_continuation(relay, target)
        if handed is None:
            relay.holding, relay.record = False, None
            self._send_part(relay, chunk)
            return
        self._leave_upstream()
        cycle.hand_over(handed, target)
        self.stage = _Stage.HANDED
        if self.fast.metrics is not None:
            self.fast.metrics.observe_fallback(Fallback.HANDOVER.value)
        self.task = asyncio.get_running_loop().create_task(
            cycle.run(self.client.receive, Resume()))
        self.task.add_done_callback(self._handed_done)

    def _handed_done(self, task: asyncio.Task[None]) -> None:
        self.task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("handed-over request failed", exc_info=task.exception())
            self.client.abort()
        self._done(499 if self.cycle.client_gone else self.status)

    def _end_stream(self, failure: UpstreamError | None, last: bytes) -> None:
        """End the client's stream after its `last` bytes (and, if it has not started,
        the first ones): with an error event if it broke. One write."""
        cycle = self.cycle
        relay = cycle.relay
        started = relay is not None
        if relay is None:  # the stream ends, or broke, before its first event was relayed
            relay = self._new_relay()
            last, self.first = self.first, b""
        out = self._for_client(relay, last)
        error, trailer = cycle.stream_outcome(self.attempt, relay, failure)
        end = out + relay.rest_for_client() + trailer
        self._settle(error)
        if started:
            self.client.end_response(end)
        else:
            self._respond(end, end=True)
        self._done(self.status)

    def _buffer(self, data: bytes) -> None:
        self.size += len(data)
        limit = self.cycle.proxy.max_response_body
        if self.size > limit:
            self._buffer_failed(UpstreamOverLimit(
                f"response body exceeds the router's {limit} byte limit"))
            return
        self.parts.append(data)

    def _end_buffered(self) -> None:
        cycle, target = self.cycle, self.target
        body = b"".join(self.parts)
        self.parts = []
        cycle.finished = True
        cycle.answer = body
        self.attempt.settled = True
        self._settle(None)
        self.client.respond(self.status, response_headers(
            self.upstream_headers, target, cycle.head.request_id, len(body)), False, body,
            True)
        self._done(self.status)

    def _buffer_failed(self, error: UpstreamError) -> None:
        name = self.target.backend.name
        if isinstance(error, UpstreamTimeout):
            message = f"backend {name} timed out: {error}"
            self._fail(504, message)
        else:
            message = f"backend {name} failed: {error}"
            self._fail(502, message)
        self.cycle.router.record_outcome(name, False, message)

    # -- endings ---------------------------------------------------------------------------

    def _may_retry(self) -> bool:
        return self.cycle.proxy.retry

    def _retry(self, retry: Retry) -> None:
        """Retry elsewhere on the coroutine path: nothing reached the client."""
        cycle, target = self.cycle, self.target
        tried = frozenset({target.backend.name})
        log.info("request %s: retrying after %s", cycle.head.request_id.decode(),
                 retry.message)
        self._leave_upstream()
        self._fall_back(Resume(tried=tried, failed=retry,
                               exclude=cycle.retry_exclude(tried, target, retry.unreachable)),
                        Fallback.RETRY)

    def _fail(self, status: int, message: str) -> None:
        """Answer an error of our own: the backend failed before the client's head."""
        cycle = self.cycle
        log.warning("request %s: %s", cycle.head.request_id.decode(), message)
        cycle.finished = True
        body = openai_error_body(status, message)
        self.status = status
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()),
                   *target_headers(self.target, cycle.head.request_id)]
        self.client.respond(status, headers, False, body, True)
        self._leave_upstream()
        self._done(status)

    def _settle(self, error: str | None) -> None:
        """The answer is read to its end: tell the router, free the backend and the
        connection before the client's last write, which may start the connection's
        next (pipelined) request."""
        cycle, target, status = self.cycle, self.target, self.status
        if error is None and status >= 500:
            error = f"HTTP {status}"
        if error is None and status < 300:
            cycle.observe_answer(target)
        if not self.attempt.cut_by_router:
            cycle.router.record_outcome(target.backend.name, error is None, error)
        self._leave_upstream()

    def _leave_upstream(self) -> None:
        """Close the upstream exchange and leave the backend (`RequestCycle.leave`: at
        once, or once it dropped an unfinished generation)."""
        if self._close_upstream():
            self.cycle.leave(self.attempt)

    def _close_upstream(self) -> bool:
        """Close the upstream exchange (its connection stays only if the answer was read
        to its end), the target still held; False if it was closed already."""
        exchange, self.upstream_exchange = self.upstream_exchange, None
        if exchange is None:
            return False
        exchange.detach()
        self.upstream.finish(exchange)
        if self.target.recall is not None:
            self.target.recall.discard(self.recalled)
        return True

    def _fall_back(self, resume: Resume, reason: Fallback) -> None:
        """The app goes on with the request, and with its body's budget."""
        self.stage = _Stage.DONE
        self.fast.count_active(-1)
        self.client.finished()
        self.fast.fall_back(self.client, resume, reason)

    def _done(self, status: int | None) -> None:
        """The request is over on this path (`status`: what the metrics count, None for
        nothing): count it and forget it."""
        if self.stage is _Stage.DONE:
            return
        self.stage = _Stage.DONE
        self._release_request()
        metrics = self.fast.metrics
        if metrics is not None and status is not None:
            target = self.target
            metrics.observe_request(target.pool, target.backend.name, status, self.ttft,
                                    time.perf_counter() - self.started_at)

    def _release_request(self) -> None:
        self.fast.proxy.bodies.give_back(self.client.held)
        self.client.held = 0
        self.fast.count_active(-1)
        self.client.finished()

    def _crash(self, exc: Exception) -> None:
        """A bug on this path: the client gets a 500 (or a cut stream), the backend is
        left, the request is counted; nothing hangs."""
        log.error("unhandled error on the callback path", exc_info=exc)
        if self.stage is _Stage.DONE:
            return
        if self.stage in (_Stage.HEAD, _Stage.FIRST, _Stage.BUFFER):
            self.status = 500
            body = openai_error_body(500, "internal router error")
            self.client.respond(500, [*JSON_HEADERS, (b"content-length",
                                                      str(len(body)).encode())], False, body,
                                True)
        else:
            self.client.abort()  # a stream cut mid-way, as a server cuts a failed app's
        self._leave_upstream()
        self._done(500)

