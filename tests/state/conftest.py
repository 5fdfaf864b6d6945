"""State tests are async (anyio on asyncio) and share a fast-clock settings helper."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from specrouter.state import StateSettings, StateStore, make_store
from tests.fixtures.redis import RedisServer

# Short intervals so the tests run in seconds; the documented defaults are checked separately.
FAST = {
    "ttl_s": 1.0,
    "heartbeat_s": 0.2,
    "publish_interval_s": 0.01,
    "refresh_interval_s": 0.03,
    "reconcile_interval_s": 0.3,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.3,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


StoreFactory = Callable[..., "asyncio.Future[StateStore]"]


@pytest.fixture
async def stores() -> AsyncIterator[Callable[..., Any]]:
    """`await stores(server, "r1", key_prefix=...)`: a started RedisStore, closed at teardown."""
    made: list[StateStore] = []

    async def make(server: RedisServer, replica_id: str, **overrides: Any) -> StateStore:
        options = {**FAST, **overrides}
        url = options.pop("redis_url", server.url())
        store = make_store(StateSettings(redis_url=url, **options), replica_id)
        made.append(store)
        await store.start()
        return store

    yield make
    for store in made:
        await store.close()
