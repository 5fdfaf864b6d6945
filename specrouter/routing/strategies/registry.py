"""The strategy table: the `strategy` value of a policy -> its strategy.

A new strategy is one module beside these and one line here; its parameters join the
policy document (`specrouter.routing.policy`) and its reasons the metric labels.
"""

from __future__ import annotations

from collections.abc import Mapping

from specrouter.routing.strategies.base import Strategy
from specrouter.routing.strategies.goodput import Goodput
from specrouter.routing.strategies.online import Online
from specrouter.routing.strategies.overflow import Overflow
from specrouter.routing.strategies.threshold import Threshold

DEFAULT_STRATEGY = "online"

STRATEGIES: Mapping[str, Strategy] = {s.name: s for s in (
    Threshold(),
    Overflow(),
    Goodput(),
    Online(),
)}
