"""The strategy protocol: how `mode: auto` picks the pool inside one group.

A strategy holds its rule, its parameters model with their defaults, the reasons it
gives and whether it switches whole groups, and nothing else. The rules every strategy
shares (health, client override, forced modes) run before it (`pool_choice.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from specrouter.observe.loadview import GroupView, LoadSignal
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.decision import Decision, GroupState

ParamsT = TypeVar("ParamsT", bound=BaseModel)


class PolicyParams(Protocol):
    """The policy as a strategy reads it: a typed view of its flat fields per model."""

    @property
    def load_signal(self) -> LoadSignal: ...

    def params(self, model: type[ParamsT]) -> ParamsT: ...


@dataclass(frozen=True)
class Situation:
    """One group at the moment of a decision; `load` is its load under the policy's
    signal, the new request not included; `sustained` its sustained load (None: not
    tracked)."""

    group: GroupView
    state: GroupState
    load: float
    now: float
    cost_model: GroupCostModel | None = None
    sustained: float | None = None


class Strategy(Protocol):
    @property
    def name(self) -> str:
        """The `strategy` value of the policy that selects it."""

    @property
    def params(self) -> type[BaseModel]:
        """Its fields of the policy document, with their defaults and validation."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every reason its `decide` can give."""

    @property
    def recalls(self) -> bool:
        """Whether a switch of a group's pool recalls the group's streams on the pool it
        left (the strategy moves whole groups)."""

    @property
    def uses_cost_model(self) -> bool:
        """Whether it predicts with the group's cost model (calibration then fits one)."""

    def decide(self, policy: PolicyParams, at: Situation) -> Decision:
        """The pool for a new request in a group with healthy backends in both pools."""

    def calibrated(self, crossover: float | None, top_level: int) -> dict[str, Any]:
        """Its parameters for a group whose measured crossover is `crossover`: the closed-loop
        concurrency at which the baseline catches up with EAGLE-3 (None: not up to the
        sweep's highest level, `top_level`)."""
