"""The assembled product: `router: prefer_eagle` is the load-aware router in mode eagle."""

from __future__ import annotations

import json

import pytest

from specrouter.assembly import build_product
from specrouter.config import load_settings
from specrouter.routing.loadaware import LoadAwareRouter
from specrouter.routing.router import RequestInfo

BACKENDS = [
    {"name": f"{g}-{p}", "url": f"http://127.0.0.1:{port}", "pool": p, "group": g}
    for g, base in (("g0", 30000), ("g1", 30010))
    for p, port in (("eagle", base), ("baseline", base + 1))
]


@pytest.mark.parametrize(("router", "mode"), [("prefer_eagle", "eagle"), ("load_aware", "auto")])
def test_router_setting_picks_the_initial_mode(router: str, mode: str) -> None:
    settings = load_settings(overrides={"router": router, "backends": BACKENDS}, environ={})
    product = build_product(settings)
    assert isinstance(product.router, LoadAwareRouter)
    assert product.policy is not None and product.policy.current.mode == mode
    target = product.router.choose(RequestInfo("/v1/chat/completions"))
    assert target.pool == "eagle"
    assert target.reason == ("forced_mode" if mode == "eagle" else "online_eagle")


def test_prefer_eagle_sends_load_to_eagle_and_falls_back_when_it_fails() -> None:
    settings = load_settings(overrides={"router": "prefer_eagle", "backends": BACKENDS,
                                        "policy": {"switch_up": 1, "switch_down": 0}},
                             environ={})
    router = build_product(settings).router
    for _ in range(4):  # far above switch_up: mode eagle ignores the load
        target = router.choose(RequestInfo("/v1/chat/completions"))
        router.acquire(target)
        assert target.pool == "eagle"
    for name in ("g0-eagle", "g1-eagle"):
        for _ in range(5):
            router.record_outcome(name, False, "connection refused")
    fallback = router.choose(RequestInfo("/v1/chat/completions"))
    assert (fallback.pool, fallback.reason) == ("baseline", "eagle_unhealthy")
    assert json.dumps(router.details())  # JSON-ready
