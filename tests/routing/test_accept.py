"""The accept-length estimate."""

from __future__ import annotations

import pytest

from specrouter.routing.accept import ewma


def test_ewma() -> None:
    assert ewma(None, 3.0, 0.3) == 3.0
    assert ewma(3.0, 1.0, 0.5) == 2.0
    with pytest.raises(ValueError):
        ewma(1.0, 1.0, 0.0)
