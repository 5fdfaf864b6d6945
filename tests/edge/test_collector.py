"""The serving process's collector settings: the start-up heap frozen, the thresholds left
as CPython sets them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from specrouter.edge.collector import tune_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_collector")
def test_tuning_freezes_what_exists_and_keeps_the_thresholds() -> None:
    before = gc.get_threshold()
    kept = [object() for _ in range(3)], {"a": [1]}  # containers that exist at tuning
    tune_collector()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    # what is frozen is in no generation the collector walks
    assert not any(o is kept[1] for gen in range(3) for o in gc.get_objects(gen))
