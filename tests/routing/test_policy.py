"""The policy document: validation, PUT and PATCH."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specrouter.routing.policy import Policy, apply_patch, apply_put


def test_policy_validation_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        Policy(switch_up=8, switch_down=8)
    errs = exc.value.errors()
    assert errs[0]["loc"] == ("switch_down",) and "less than switch_up" in errs[0]["msg"]
    with pytest.raises(ValidationError) as exc:
        Policy.model_validate({"mode": "fast", "eagle_cap": 0, "bogus": 1})
    locs = {e["loc"] for e in exc.value.errors()}
    assert locs == {("mode",), ("eagle_cap",), ("bogus",)}


def test_put_and_patch_bump_version_and_keep_old_on_error() -> None:
    p1 = Policy()
    p2 = apply_patch(p1, {"strategy": "overflow", "eagle_cap": 12, "version": 99})
    assert (p2.version, p2.strategy, p2.eagle_cap, p2.switch_up) == (2, "overflow", 12, 16)
    assert p2.updated_at >= p1.updated_at
    p3 = apply_put(p2, {"mode": "baseline"})
    # PUT replaces: the strategy is back to the default, `online`
    assert (p3.version, p3.strategy, p3.eagle_cap, p3.mode) == (3, "online", 8, "baseline")
    with pytest.raises(ValidationError):
        apply_patch(p3, {"switch_down": 100})
    assert p3.version == 3 and p3.public()["mode"] == "baseline"
