"""The descriptor budget: what fits a soft RLIMIT_NOFILE, what is lowered, what is refused."""

from __future__ import annotations

import json
import subprocess

import pytest

from specrouter.commands.descriptors import (
    MIN_CLIENT_CONNECTIONS,
    DescriptorBudgetError,
    merge_overrides,
    plan_budget,
    upstream_bound,
)
from specrouter.config import Settings, load_settings
from tests.fixtures.procs import REPO_ROOT, free_port, specrouter_argv

BACKENDS = [{"name": f"b{i}", "url": f"http://127.0.0.1:{30000 + i}",
             "pool": "eagle" if i % 2 == 0 else "baseline", "group": f"g{i // 2}"}
            for i in range(4)]


def _settings(**overrides: object) -> Settings:
    return load_settings(overrides={"backends": BACKENDS, **overrides}, environ={})


def test_the_configured_limits_stay_when_they_fit() -> None:
    budget = plan_budget(_settings(), 1 << 20)
    assert not budget.lowered and budget.overrides() == {}
    assert budget.max_connections == 4096 and budget.max_idle_per_backend == 1024
    assert budget.needed <= budget.limit


@pytest.mark.parametrize("limit", [192, 256, 1024, 4096])
def test_limits_are_lowered_to_fit_with_the_reserve_kept(limit: int) -> None:
    budget = plan_budget(_settings(), limit)
    assert budget.lowered
    assert budget.needed <= limit
    assert budget.max_connections >= MIN_CLIENT_CONNECTIONS
    # one more client connection would not fit
    bigger = budget.max_connections + 1
    assert budget.reserve + bigger + upstream_bound(
        bigger, 4, budget.max_connections_per_backend, budget.max_idle_per_backend) > limit
    lowered = budget.apply(_settings())
    assert lowered.limits.max_connections == budget.max_connections
    assert lowered.upstream.max_idle_per_backend == budget.max_idle_per_backend


def test_a_limit_too_low_for_a_minimal_budget_is_refused_with_the_fix() -> None:
    with pytest.raises(DescriptorBudgetError, match=r"at least \d+ are needed\. Raise `nofile`"):
        plan_budget(_settings(), 64)


def test_a_small_configured_limit_is_kept_not_refused() -> None:
    budget = plan_budget(_settings(limits={"max_connections": 4}), 256)
    assert budget.max_connections == 4 and budget.needed <= 256  # only the idle pool shrank


def test_merge_keeps_the_other_fields_of_a_section() -> None:
    merged = merge_overrides({"limits": {"max_body_bytes": 10}, "workers": 2},
                             {"limits": {"max_connections": 5}})
    assert merged == {"limits": {"max_body_bytes": 10, "max_connections": 5}, "workers": 2}


def test_serve_refuses_to_start_under_a_tiny_nofile() -> None:
    argv = ["prlimit", "--nofile=48:48", *specrouter_argv(
        "serve", "--host", "127.0.0.1", "--port", str(free_port()))]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin",
                               "SPECROUTER_BACKENDS": json.dumps(BACKENDS[:2])})
    assert done.returncode == 2, done.stderr
    assert "specrouter serve: refused: the descriptor limit (RLIMIT_NOFILE) is 48" in done.stderr
