"""The serving process's collector settings: the start-up heap frozen, the first
generation's threshold raised, the older generations' left as CPython sets them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from specrouter.edge.collector import GEN0_THRESHOLD, tune_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_collector")
def test_tuning_freezes_what_exists_and_raises_the_first_threshold() -> None:
    before = gc.get_threshold()
    kept = [object() for _ in range(3)], {"a": [1]}  # containers that exist at tuning
    tune_collector()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2])
    assert before[0] < GEN0_THRESHOLD
    # what is frozen is in no generation the collector walks
    assert not any(o is kept[1] for gen in range(3) for o in gc.get_objects(gen))
