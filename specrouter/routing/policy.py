"""The routing policy as data: one flat, validated, versioned document.

`Policy` holds the fields every strategy shares and, flat beside them, the fields of each
strategy's parameters model (`strategies.registry`) and of the accept-length estimate;
code reads a strategy's fields through the typed view `policy.params(Model)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model

from specrouter.observe.loadview import LoadSignal
from specrouter.routing.accept import AcceptParams
from specrouter.routing.strategies.registry import DEFAULT_STRATEGY, STRATEGIES

Mode = Literal["auto", "eagle", "baseline"]
ParamsT = TypeVar("ParamsT", bound=BaseModel)


class PolicyCore(BaseModel):
    """The fields every strategy shares. Server-managed: `version` and `updated_at`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(default=1, ge=1)
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    mode: Mode = "auto"
    strategy: str = DEFAULT_STRATEGY  # one of the registry's names (checked in `Policy`)
    load_signal: LoadSignal = "max"
    allow_client_override: bool = False

    _views: dict[type[BaseModel], BaseModel] = PrivateAttr(default_factory=dict)

    def params(self, model: type[ParamsT]) -> ParamsT:
        """This policy's fields of `model` (a strategy's parameters), already validated."""
        views: dict[type[BaseModel], BaseModel] = cast(
            dict[str, Any], self.__pydantic_private__)["_views"]
        view = views.get(model)  # read on every decision: no pydantic attribute lookup
        if view is None:
            view = views[model] = model.model_construct(
                **{k: getattr(self, k) for k in model.model_fields})
        return cast(ParamsT, view)

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Self:
        copied = super().model_copy(update=update, deep=deep)
        object.__setattr__(copied, "__pydantic_private__", {"_views": {}})  # views of `self`
        return copied

    def public(self) -> dict[str, Any]:
        """JSON-ready form for GET /policy."""
        return self.model_dump(mode="json")


def _compose() -> type[PolicyCore]:
    """`PolicyCore` with every parameters model's fields and validators, flat, and
    `strategy` restricted to the registry's names."""
    models: list[type[BaseModel]] = [*(s.params for s in STRATEGIES.values()), AcceptParams]
    names: Any = cast(Any, Literal)[tuple(STRATEGIES)]
    bases: tuple[type[BaseModel], ...] = (*reversed(models), PolicyCore)
    policy = create_model("Policy", __base__=bases, __module__=__name__,
                          strategy=(names, DEFAULT_STRATEGY))
    return cast(type[PolicyCore], policy)


if TYPE_CHECKING:
    Policy = PolicyCore
else:
    Policy = _compose()


class PolicySource(Protocol):
    """Where the router reads the policy in force (control's `PolicyHolder`)."""

    @property
    def current(self) -> Policy: ...


_SERVER_FIELDS = ("version", "updated_at")


def apply_put(current: Policy, body: Mapping[str, Any], now: datetime | None = None) -> Policy:
    """PUT: replace the policy. Raises pydantic.ValidationError (-> 422 with .errors()).

    `version` and `updated_at` in the body are ignored: the server numbers changes.
    """
    fields = {k: v for k, v in body.items() if k not in _SERVER_FIELDS}
    return Policy.model_validate(
        {**fields, "version": current.version + 1, "updated_at": now or datetime.now(UTC)}
    )


def apply_patch(current: Policy, body: Mapping[str, Any], now: datetime | None = None) -> Policy:
    """PATCH: merge `body` into the current policy, validated as a whole."""
    merged = {**current.model_dump(exclude=set(_SERVER_FIELDS)), **body}
    return apply_put(current, merged, now)
