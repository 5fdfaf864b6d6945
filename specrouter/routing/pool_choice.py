"""The pool (EAGLE-3 or baseline) for one new request inside its group.

The rules every strategy shares come first: a client's override where the policy allows
it, an unhealthy pool, a forced mode; then the policy's strategy decides. Pure: the
group view, the clock and the group's state come in, the new state goes out in the
`Decision`. Reasons are short stable strings: metric labels and a response header.
"""

from __future__ import annotations

from dataclasses import replace

from specrouter.backends import Pool
from specrouter.observe.loadview import GroupView
from specrouter.routing.accept import AcceptParams, fold
from specrouter.routing.affinity.pricing import AFFINITY_REASONS
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.decision import Decision, GroupState, Hints, NoHealthyPool
from specrouter.routing.policy import Policy
from specrouter.routing.strategies.base import Situation
from specrouter.routing.strategies.registry import STRATEGIES

_SHARED_REASONS = ("client_override", "forced_mode", "eagle_unhealthy", "baseline_unhealthy",
                   "handover_follows_group")
#: Every reason a pool decision can give (`decide`, then the affinity override), checked by
#: the property tests and listed in docs/policy.md.
REASONS: tuple[str, ...] = (
    *_SHARED_REASONS, *(r for s in STRATEGIES.values() for r in s.reasons), *AFFINITY_REASONS)


def fold_accept(policy: Policy, group: GroupView, state: GroupState,
                cost_model: GroupCostModel | None = None) -> GroupState:
    """`state` with the group's newest accept-length reading in its estimate."""
    nominal = None if cost_model is None else cost_model.nominal_accept_length
    accept = fold(policy.params(AcceptParams), group, state.accept, nominal)
    return state if accept is state.accept else replace(state, accept=accept)


def decide(
    policy: Policy,
    group: GroupView,
    state: GroupState,
    hints: Hints,
    now: float,
    cost_model: GroupCostModel | None = None,
) -> Decision:
    """The pool for one new request in `group`. Store `Decision.state` for the next one."""
    state = fold_accept(policy, group, state, cost_model)
    load = group.load(policy.load_signal)
    eagle_ok, base_ok = group.pool_healthy("eagle"), group.pool_healthy("baseline")
    if not (eagle_ok or base_ok):
        raise NoHealthyPool(f"group {group.name!r} has no healthy backend")

    def fixed(pool: Pool, reason: str) -> Decision:
        return Decision(pool, reason, state, load)

    want = hints.requested_pool if policy.allow_client_override else None
    if want is not None and group.pool_healthy(want):
        return fixed(want, "client_override")
    if not eagle_ok:
        return fixed("baseline", "eagle_unhealthy")
    if not base_ok:
        return fixed("eagle", "baseline_unhealthy")
    if policy.mode != "auto":
        return fixed(policy.mode, "forced_mode")
    strategy = STRATEGIES[policy.strategy]
    decision = strategy.decide(policy, Situation(group, state, load, now, cost_model,
                                                 group.sustained))
    return replace(decision, recalls=True) if strategy.recalls else decision


def follow_group(decision: Decision, state: GroupState) -> Decision:
    """The decision for a handed-over stream's continuation: the pool its group is on
    (`state`), never a switch. The continuation replaces a stream the group's switch
    moved; decided as a new arrival, it would count that stream twice (its first
    attempt stays counted until the engine acknowledges the abort) and could switch the
    group straight back, recalling the requests that had just switched it."""
    if decision.state.pool == state.pool:
        return decision
    return replace(decision, pool=state.pool, reason="handover_follows_group", state=state)
