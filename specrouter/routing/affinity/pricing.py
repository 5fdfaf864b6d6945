"""What affinity is worth, in milliseconds: pure arithmetic over tokens and loads.

Prefilling `u` uncached prompt tokens takes `u * prefill_ms_per_token` of the GPU, and
the GPU is shared: while a prefill batch runs, every running request of both servers of
that GPU waits for it. So a prefill costs `u * prefill_ms_per_token * (1 + load)`
request-milliseconds in a group already running `load` requests. Joining a group costs
the request `load_ms` for each request already there (its decode steps are shared).

- Group choice: each candidate group costs
  `uncached * prefill_ms_per_token * (1 + load) + load * load_ms`; the cheapest wins.
  With no prefix held anywhere every group has the same uncached tokens and the rule is
  least loaded, as without affinity. A group holding less than `min_match` of the
  prompt is priced as holding nothing: the first turn of a session shares only the
  system prompt with others, and where it lands its later turns follow, so its
  placement is a load decision, not a cache one (the gateway's `cache_threshold`). A
  group whose load passes `balance_rel * least + balance_abs` is priced as holding
  nothing too: affinity never piles sessions onto a group far busier than the idlest.
- Pool choice: when the strategy sends a request to EAGLE-3 but the group's baseline
  server holds more of its prefix, the switch re-prefills the difference on the shared
  GPU. The request stays on the baseline (`affinity_hold_baseline`) when that costs more
  than what EAGLE-3 saves on its answer: `expected_output_tokens` times the per-token
  saving (the cost model's predicted per-token times where there is one, else
  `eagle_saving_ms_per_token`). A decision for the baseline is always followed: it is
  the strategy's answer to load, which moves the whole group, and one request kept on
  EAGLE-3 slows every request of that server's batch, which this price does not count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from specrouter.backends import Pool
from specrouter.observe.loadview import GroupView
from specrouter.routing.costmodel import PoolPrediction
from specrouter.routing.decision import Decision

#: The reasons the affinity override gives (part of pool_choice.REASONS).
AFFINITY_REASONS: tuple[str, ...] = ("affinity_hold_baseline",)


@dataclass(frozen=True, slots=True)
class AffinityPrices:
    prefill_ms_per_token: float = 0.021
    load_ms: float = 50.0
    balance_abs: float = 8.0
    balance_rel: float = 2.0
    min_match: float = 0.5
    expected_output_tokens: int = 256
    eagle_saving_ms_per_token: float = 2.0


@dataclass(frozen=True, slots=True)
class GroupAffinity:
    """What the group choice knows of one request's prefix: per group, the most prompt
    tokens one of its healthy servers holds, and the prompt's estimated tokens."""

    held: Mapping[str, float]
    prompt_tokens: float
    prices: AffinityPrices

    def cost(self, group: str, load: float, least: float) -> float:
        p = self.prices
        held = self.held.get(group, 0.0)
        if (load > p.balance_rel * least + p.balance_abs
                or held < p.min_match * self.prompt_tokens):
            held = 0.0
        uncached = max(0.0, self.prompt_tokens - held)
        return uncached * p.prefill_ms_per_token * (1.0 + load) + load * p.load_ms


def switch_cost_ms(extra_tokens: float, load: float, prices: AffinityPrices) -> float:
    """Request-milliseconds of prefilling `extra_tokens` more on a GPU running `load`."""
    return max(0.0, extra_tokens) * prices.prefill_ms_per_token * (1.0 + load)


def eagle_saving_ms(predictions: Mapping[Pool, PoolPrediction] | None,
                    prices: AffinityPrices) -> float:
    """What EAGLE-3 saves on one answer against the baseline."""
    if predictions is not None and "eagle" in predictions and "baseline" in predictions:
        per_token = predictions["baseline"].tpot_ms - predictions["eagle"].tpot_ms
    else:
        per_token = prices.eagle_saving_ms_per_token
    return max(0.0, per_token) * prices.expected_output_tokens


def hold_pool(decision: Decision, group: GroupView, held: Mapping[str, float],
              prices: AffinityPrices) -> Decision:
    """`decision` (a strategy's choice for a request in `group`), or the baseline with
    `affinity_hold_baseline` when the request's prefix is on the group's baseline server
    and moving it to EAGLE-3 costs more prefill than EAGLE-3 saves on the answer; `held`
    maps backend names to the prompt tokens each holds. A decision for the baseline is
    returned as it is."""
    if decision.pool != "eagle":
        return decision
    on_eagle = max((held.get(b.name, 0.0) for b in group.healthy_servers("eagle")), default=0.0)
    on_base = max((held.get(b.name, 0.0) for b in group.healthy_servers("baseline")),
                  default=0.0)
    if on_base <= on_eagle:
        return decision
    saving = eagle_saving_ms(decision.predictions, prices)
    if switch_cost_ms(on_base - on_eagle, decision.load, prices) <= saving:
        return decision
    return replace(decision, pool="baseline", reason="affinity_hold_baseline", recalls=False)
