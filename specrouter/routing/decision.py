"""What one pool decision reads and returns: the request's hints, the group's state and
the decision itself. Immutable, so a decision can be computed for a report and dropped."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specrouter.backends import POOL_HEADER, Pool
from specrouter.routing.accept import AcceptEstimate
from specrouter.routing.costmodel import PoolPrediction


class HeaderError(ValueError):
    """A bad x-specrouter-pool value: the router answers 400."""


def parse_pool_header(value: str | None) -> Pool | None:
    if value is None or not value.strip():
        return None
    v = value.strip().lower()
    if v == "eagle":
        return "eagle"
    if v == "baseline":
        return "baseline"
    raise HeaderError(f"{POOL_HEADER} must be 'eagle' or 'baseline', got {value!r}")


@dataclass(frozen=True)
class Hints:
    """What the request itself says; `requested_pool` from `parse_pool_header`."""

    requested_pool: Pool | None = None


@dataclass(frozen=True)
class GroupState:
    """The memory of one group between decisions: its pool, when it switched to it
    (monotonic s), when the goodput strategy last probed its EAGLE-3 server, and the
    accept-length estimate."""

    pool: Pool = "eagle"
    since: float = float("-inf")
    probe_at: float = float("-inf")
    accept: AcceptEstimate = field(default_factory=AcceptEstimate)

    def switched(self, pool: Pool, now: float) -> GroupState:
        """This state on `pool`; `since` moves only on a real switch."""
        return self if self.pool == pool else GroupState(pool, now, self.probe_at, self.accept)

    def as_dict(self) -> dict[str, Any]:
        """The `state` of a group in GET /policy."""
        a = self.accept
        return {"pool": self.pool, "since": self.since, "accept_ewma": a.ewma,
                "accept_seen_at": a.seen_at, "probe_at": self.probe_at,
                "accept_trend": a.trend, "accept_peak": a.peak}


@dataclass(frozen=True)
class Decision:
    """The pool for one request, why, and the group's state to keep for the next one.

    `recalls`: a later switch of the group's pool moves this request off its pool
    (recalled before its first byte, handed over after it): the strategy chose the pool
    and switches whole groups. `probe_tokens`: also send a shadow probe of this size to
    the group's EAGLE-3 server.
    """

    pool: Pool
    reason: str
    state: GroupState
    load: float
    predictions: Mapping[Pool, PoolPrediction] | None = None
    recalls: bool = False
    probe_tokens: int | None = None


class NoHealthyPool(RuntimeError):
    """The group has no healthy backend; `choose_group` never picks such a group."""
