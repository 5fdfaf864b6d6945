"""Wiring of the product: settings in, the ASGI app out.

    settings -> policy holder, health checker, load-aware router (telemetry inside)
             -> proxy app (specrouter.edge.app) + /policy + /metrics, wrapped in the metrics
                middleware that times each request

`serve` and `demo` both call `build_app`, so what a user runs on a laptop is what runs
in production. Swapping a part (the policy holder for one backed by the cluster store,
say) happens here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from starlette.routing import BaseRoute

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
from specrouter.routing.router import Backend, PreferEagleRouter, Router


@dataclass
class Product:
    """The assembled parts, for tests and embedding; `asgi` is what uvicorn serves."""

    asgi: MetricsMiddleware
    app: SpecRouterApp
    router: Router
    metrics: RouterMetrics
    policy: PolicyHolder | None
    state: ClusterState | None = None


def build_product(
    settings: Settings,
    upstreams: Mapping[str, Upstream] | None = None,
    policy: PolicyHolder | None = None,
    cost_models: Mapping[str, GroupCostModel] | None = None,
) -> Product:
    backends = [Backend.from_config(b) for b in settings.backends]
    metrics = RouterMetrics()
    extra: list[BaseRoute] = [metrics_route(metrics)]
    router: Router
    state: ClusterState | None = None
    if settings.router == "prefer_eagle":
        router, holder = PreferEagleRouter(backends), None
    else:
        if settings.redis_url is not None and policy is None:
            # Cluster mode: policy and in-flight counts shared through Redis.
            state = ClusterState.from_settings(settings.state_settings(), settings.policy)
            metrics.registry.register(StateCollector(state))
        holder = (policy if policy is not None else
                  state.holder if state is not None else LocalPolicyHolder(settings.policy))
        health = HealthChecker(backends, settings.health, settings.breaker)
        models = settings.group_cost_models() if cost_models is None else cost_models
        load_aware = LoadAwareRouter(
            backends, holder, health, settings.telemetry, metrics, models,
            arrival_window_s=settings.admission.arrival_window_ms / 1000.0, state=state,
            arrival_max_wait_s=settings.admission.arrival_max_wait_ms / 1000.0,
            recall_unstarted=settings.admission.recall_unstarted)
        admin = AdminApi(holder, load_aware.live_view, settings.admin_token,
                         settings.admin_max_body_bytes)
        extra = [*admin.routes(), *extra]
        router = load_aware
    app = create_app(settings, router, upstreams, extra_routes=extra)
    return Product(MetricsMiddleware(app, metrics), app, router, metrics, holder, state)


def build_app(settings: Settings) -> MetricsMiddleware:
    """The ASGI app `specrouter serve` runs."""
    return build_product(settings).asgi
