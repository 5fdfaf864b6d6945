"""Injected faults and knobs of one simulated engine, set through POST /sim/control.

Not part of SGLang: they let tests and benchmarks make an engine fail in the ways real ones
do (5xx, slowness, stalls, cut streams, refused connections) and shift the workload
(accept length). Latencies here are real milliseconds, not scaled by --time-scale, because they
model the network and HTTP layer, which a test observes in real time.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any


class ControlError(ValueError):
    """A /sim/control field is unknown or has the wrong type."""


@dataclass
class Faults:
    error_rate: float = 0.0  # share of generation requests answered with a 5xx
    error_status: int = 500
    added_latency_ms: float = 0.0  # before a generation request is scheduled
    stall: bool = False  # accept generation requests and never answer them
    cut_stream_after_tokens: int | None = None  # drop the connection mid-stream
    refuse_connections: bool = False  # close the listening socket
    refuse_for_s: float | None = None  # real seconds until the socket reopens by itself
    slow_health_ms: float = 0.0  # /health, /health_generate, /ready answer this much later
    wedged: bool = False  # the scheduler runs no step; /health fails after its timeout
    starting: bool = False  # the server is still starting: /health and /ready answer 503
    loads_reader_detached: bool = False  # 0.5.23: /v1/loads answers "loads": []

    def should_error(self, rng: random.Random) -> bool:
        return self.error_rate > 0 and rng.random() < self.error_rate

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FLOATS = ("error_rate", "added_latency_ms", "slow_health_ms")


def apply_control(faults: Faults, fields: dict[str, Any]) -> None:
    """Validate every field first, then apply, so a bad call changes nothing."""
    updates: dict[str, Any] = {}
    for key, value in fields.items():
        if key in _FLOATS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ControlError(f"{key} must be a non-negative number")
            if key == "error_rate" and value > 1:
                raise ControlError("error_rate must be within 0..1")
            updates[key] = float(value)
        elif key in ("stall", "wedged", "starting", "loads_reader_detached"):
            if not isinstance(value, bool):
                raise ControlError(f"{key} must be true or false")
            updates[key] = value
        elif key == "refuse_connections":
            # true/false, or a number of real seconds after which the port reopens (the way
            # back when no sibling engine's /sim/control can reach this one)
            if isinstance(value, bool):
                updates[key], updates["refuse_for_s"] = value, None
            elif isinstance(value, int | float) and value > 0:
                updates[key], updates["refuse_for_s"] = True, float(value)
            else:
                raise ControlError("refuse_connections must be true, false or seconds > 0")
        elif key == "cut_stream_after_tokens":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ControlError("cut_stream_after_tokens must be null or an integer >= 0")
            updates[key] = value
        elif key == "error_status":
            if isinstance(value, bool) or not isinstance(value, int) or not 500 <= value <= 599:
                raise ControlError("error_status must be an integer 500..599")
            updates[key] = value
        else:
            raise ControlError(f"unknown fault field {key!r}")
    for key, value in updates.items():
        setattr(faults, key, value)
