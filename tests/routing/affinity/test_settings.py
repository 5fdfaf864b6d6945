"""The affinity settings are checked at start-up with a message for the operator."""

from __future__ import annotations

import pytest

from specrouter.config import ConfigError, Settings, load_settings

BACKENDS = [{"name": "e0", "url": "http://h:1", "pool": "eagle", "group": "g0"},
            {"name": "b0", "url": "http://h:2", "pool": "baseline", "group": "g0"}]


def settings(**affinity: object) -> Settings:
    return load_settings(overrides={"backends": BACKENDS, "affinity": affinity}, environ={})


@pytest.mark.parametrize(("fields", "message"), [
    ({"block_bytes": 64}, "block_bytes"),
    ({"cache_tokens_by_backend": {"e9": 1000}}, "no backend named e9"),
    ({"cache_tokens_by_backend": {"e0": 0}}, "e0 must be at least 1"),
    ({"min_match": 1.5}, "min_match"),
    ({"balance_rel": 0.5}, "balance_rel"),
    ({"session_header": "x"}, "session_header"),
])
def test_bad_affinity_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings(**fields)


def test_defaults_and_a_per_backend_pool() -> None:
    s = settings(cache_tokens_by_backend={"e0": 300_000})
    assert s.affinity.enabled
    assert s.affinity.cache_tokens_by_backend == {"e0": 300_000}

