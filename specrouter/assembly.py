"""Wiring of the product: settings in, the ASGI app out.

    settings -> policy holder, backend monitor (health checks, telemetry, cluster counts)
             -> load-aware router -> proxy app (specrouter.edge.app) + /policy + /metrics,
                wrapped in the metrics middleware that times each request

`serve` and `demo` both call `build_app`, so what runs on a laptop is what runs in
production. Parts are chosen here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from starlette.routing import BaseRoute

from specrouter.backends import Backend
from specrouter.config import Settings
from specrouter.control.admin import AdminApi
from specrouter.control.clusterstate import ClusterState, StateCollector
from specrouter.control.holder import LocalPolicyHolder, PolicyHolder
from specrouter.control.metrics import MetricsMiddleware, RouterMetrics, metrics_route
from specrouter.edge.app import SpecRouterApp, create_app
from specrouter.observe.health import HealthChecker
from specrouter.proxy.upstream import Upstream
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.monitor import BackendMonitor
from specrouter.routing.policy import Policy
from specrouter.routing.router import Router


@dataclass
class Product:
    """The assembled parts, for tests and embedding; `asgi` is what uvicorn serves."""

    asgi: MetricsMiddleware
    app: SpecRouterApp
    router: Router
    metrics: RouterMetrics
    policy: PolicyHolder | None
    state: ClusterState | None = None


def initial_policy(settings: Settings) -> Policy:
    """The policy at start-up; `router: prefer_eagle` is the load-aware router in
    `mode: eagle`."""
    if settings.router == "prefer_eagle":
        return settings.policy.model_copy(update={"mode": "eagle"})
    return settings.policy


def build_product(
    settings: Settings,
    upstreams: Mapping[str, Upstream] | None = None,
    policy: PolicyHolder | None = None,
    cost_models: Mapping[str, GroupCostModel] | None = None,
) -> Product:
    backends = [Backend.from_config(b) for b in settings.backends]
    metrics = RouterMetrics()
    state: ClusterState | None = None
    if settings.redis_url is not None and policy is None:
        # Cluster mode: policy and in-flight counts shared through Redis.
        state = ClusterState.from_settings(settings.state_settings(), initial_policy(settings))
        metrics.registry.register(StateCollector(state))
    holder = (policy if policy is not None else
              state.holder if state is not None else LocalPolicyHolder(initial_policy(settings)))
    health = HealthChecker(backends, settings.health, settings.breaker)
    monitor = BackendMonitor(backends, health, settings.telemetry, state,
                             prefill_ms_per_token=settings.affinity.prefill_ms_per_token)
    router = LoadAwareRouter(
        monitor, holder, settings.admission, metrics=metrics,
        cost_models=settings.group_cost_models() if cost_models is None else cost_models,
        affinity=settings.affinity)
    metrics.attach(router.live_metrics)
    admin = AdminApi(holder, router.live_view, settings.admin_token,
                     settings.admin_max_body_bytes)
    extra: list[BaseRoute] = [*admin.routes(), metrics_route(metrics)]
    app = create_app(settings, router, upstreams, extra_routes=extra,
                     metrics=metrics)
    return Product(MetricsMiddleware(app, metrics), app, router, metrics, holder, state)


def build_app(settings: Settings) -> MetricsMiddleware:
    """The ASGI app `specrouter serve` runs."""
    return build_product(settings).asgi
