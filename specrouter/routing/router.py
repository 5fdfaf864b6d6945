"""Where a request goes: the one routing seam of the proxy.

The proxy never picks a backend itself. It asks a `Router` to `settle` then
`choose(request) -> Target`, tells it when a request is admitted to and released from a
backend, and reports each upstream outcome. Load views, telemetry, policies, breakers
and shared state all live behind this protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specrouter.backends import Backend, Pool
from specrouter.routing.affinity.keys import PrefixKeys
from specrouter.routing.arrivals import Arrival


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What routing may look at: cheap facts peeked from the request, never the body.

    `pool` is a pool the route itself requires (other `/v1/*` paths go to the baseline
    pool); `pool_header` is the client's raw `x-specrouter-pool` header, which a policy
    may honour; `exclude` holds backends already tried for this request (retry).
    """

    path: str
    model: str | None = None
    stream: bool = False
    pool: Pool | None = None
    pool_header: str | None = None
    exclude: frozenset[str] = frozenset()
    # requests of a burst still arriving that the decision should count (the router's
    # `settle` says how many)
    burst_ahead: int = 0
    # the request was recalled from EAGLE-3 before its first byte (`Target.recall`), or
    # handed over after it (`handed_over`): its next target is final
    recalled: bool = False
    handed_over: bool = False
    # the prompt's block keys and the client's session key (routing.affinity.keys)
    prefix: PrefixKeys | None = None
    session: str | None = None


class HandoverBudget:
    """The context tokens the streams handed over at one switch of a group may total:
    each is prefilled again on the group's GPU, ahead of the requests arriving then."""

    __slots__ = ("left",)

    def __init__(self, tokens: float) -> None:
        self.left = tokens

    def take(self, tokens: float) -> bool:
        """Claim `tokens` of the budget; False (nothing claimed) when they do not fit."""
        if tokens > self.left:
            return False
        self.left -= tokens
        return True


class RecallEvent(asyncio.Event):
    """An `asyncio.Event` that also runs callbacks, synchronously, when first set: a
    recall cancels the attempt's work from its callback, so waiting for the work or the
    recall takes no second task and no `asyncio.wait`. `budget` is the handover budget
    of the switch that set it, shared by the group's streams."""

    def __init__(self) -> None:
        super().__init__()
        self._on_set: list[Callable[[], object]] = []
        self.budget: HandoverBudget | None = None

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        callbacks, self._on_set = self._on_set, []
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], object]) -> None:
        self._on_set.append(callback)

    def discard(self, callback: Callable[[], object]) -> None:
        with contextlib.suppress(ValueError):
            self._on_set.remove(callback)


@dataclass(frozen=True, slots=True)
class Target:
    group: str
    pool: Pool
    backend: Backend
    reason: str
    probe: Probe | None = None  # a shadow probe to send alongside this request
    # Set by the router when the request should leave this backend for another pool if
    # it has not sent its first byte yet (the group switched pools meanwhile): the proxy
    # then closes the upstream request and asks `choose` again with `recalled=True`.
    recall: RecallEvent | None = None
    # the prompt tokens `backend` is estimated to prefill (its cached prefix left out),
    # which the cost model's readings are taken net of (routing/learning.py)
    prefill_tokens: float = 0.0
    # the request's prompt tokens by the router's estimate (0: not known, or not a
    # client's generation): the traffic's context, which cost probes decode at
    prompt_tokens: float = 0.0
    # the accept length the router expects of `backend` (EAGLE-3): output tokens per
    # streamed event, which a handover counts the tokens sent by
    accept_length: float | None = None
    # the client's session key (`x-session-id`) where the affinity tracker follows it:
    # the session stays live while the request is in flight (routing/affinity/index.py)
    session: str | None = None
    # the share of the prompt the affinity index predicts `backend` holds (before the
    # observed retention scales it), which the engine's report of cached tokens is
    # compared with
    predicted_cached: float = 0.0
    # a request of the router's own (a cost probe's generation, a goodput shadow probe):
    # in flight like a client's, but no part of the clients' sustained load
    own: bool = False
    # when this request took `backend`'s half-open trial slot (None: it took none): its
    # release frees the slot if it ended without an outcome, so a client that leaves
    # before the engine answers does not keep the backend out for the trial's timeout
    trial: float | None = None


@dataclass(frozen=True, slots=True)
class Probe:
    """A shadow copy of the request to send to `target` (specrouter.proxy.shadow)."""

    target: Target
    max_tokens: int


class NoBackendAvailable(Exception):
    """No healthy backend can take the request: the proxy answers 503."""


class Router(Protocol):
    """What the proxy needs from routing. Implementations run on one event loop."""

    @property
    def backends(self) -> Sequence[Backend]: ...

    async def settle(self, request: RequestInfo) -> int:
        """Before the first `choose`: may wait (the arrival window) and returns how many
        more requests of a burst the decision should expect (`RequestInfo.burst_ahead`)."""

    def arrive(self, request: RequestInfo) -> Arrival | None:
        """`settle` in two steps, for a caller that cannot wait at once: record the
        request's arrival; an `Arrival` says it should `wait` before its `choose`."""

    async def wait(self, arrival: Arrival) -> int:
        """`settle`'s wait for an arrival `arrive` returned; `settle`'s result."""

    def choose(self, request: RequestInfo) -> Target:
        """The backend for a new request; raise NoBackendAvailable when there is none."""

    def acquire(self, target: Target) -> None:
        """The request was admitted to `target.backend` (called right after `choose`)."""

    def release(self, target: Target) -> None:
        """The request left `target.backend`: called exactly once per `acquire`, in every
        path (success, upstream error, client disconnect, cancellation)."""

    def record_outcome(self, backend: str, ok: bool, error: str | None = None) -> None:
        """Passive health: ok=False for connection errors and 5xx statuses."""

    def observe_cached(self, target: Target, prompt_tokens: int, cached_tokens: int) -> None:
        """The engine's report for a request answered by `target.backend`: of its
        `prompt_tokens`, `cached_tokens` were in its prefix cache."""

    def observe_pace(self, target: Target, tpot_ms: float) -> None:
        """A streamed answer from `target.backend` took `tpot_ms` per output token after
        its first, in the router's clock."""

    def healthy(self, backend: str) -> bool: ...

    def inflight(self, backend: str) -> int: ...

    def details(self) -> dict[str, Any]:
        """Router state for GET /ready (JSON-ready)."""

    async def start(self) -> None:
        """Start background work (telemetry, health checks); called at app start-up."""

    async def stop(self) -> None: ...
