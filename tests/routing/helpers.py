"""Builders of immutable views for the pure-policy tests."""

from __future__ import annotations

from specrouter.backends import Pool
from specrouter.observe.loadview import BackendView, GroupView


def backend(
    name: str, pool: Pool, inflight: int = 0, engine: float | None = None,
    healthy: bool = True, accept: float | None = None, accept_at: float | None = None,
) -> BackendView:
    return BackendView(
        name=name, pool=pool, healthy=healthy, inflight=inflight, engine=engine,
        telemetry_age=None if engine is None else 0.0, stale=engine is None,
        accept_length=accept, accept_seen_at=accept_at if accept is not None else None,
    )


def group(
    name: str = "gpu0", eagle: int = 0, base: int = 0, eagle_ok: bool = True,
    base_ok: bool = True, accept: float | None = None, accept_at: float | None = None,
) -> GroupView:
    return GroupView(name, (
        backend(f"{name}-eagle", "eagle", eagle, healthy=eagle_ok, accept=accept,
                accept_at=accept_at),
        backend(f"{name}-base", "baseline", base, healthy=base_ok),
    ))
