"""`loadtest.ab`: variants parsed with clear errors, a `tree` variant that runs the tree's
package although the working directory holds another, and one short real comparison."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import ab

REPO = Path(__file__).resolve().parents[2]


def test_variants_parse_and_bad_ones_say_why() -> None:
    v = ab.parse_variant('noaff={"env": {"SPECROUTER_AFFINITY__ENABLED": false}}')
    assert (v.name, v.env, v.python, v.tree) == (
        "noaff", {"SPECROUTER_AFFINITY__ENABLED": "False"}, sys.executable, None)
    assert ab.parse_variant("default=").env == {}
    for relay in ("floor-asgi", "floor-routed", "sglang-router"):
        assert ab.parse_variant(relay).name == relay
    for bad in ("default", '={"env": {}}', 'x={"envs": {}}'):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected NAME=SPEC|takes env"):
            ab.parse_variant(bad)


def test_a_tree_variant_imports_the_trees_package_ahead_of_the_working_directory(
        tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "specrouter").mkdir(parents=True)
    (tree / "specrouter" / "__init__.py").write_text("MARK = 'tree'\n")
    variant = ab.parse_variant(f'other={{"tree": "{tree}"}}')
    env = {**os.environ, **variant.process_env()}
    # `-c`, like `-m`, puts the working directory (this checkout) first on sys.path
    shown = subprocess.run(
        [sys.executable, "-c", "import specrouter; print(specrouter.__file__)"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(shown).resolve() == (tree / "specrouter" / "__init__.py").resolve()
    plain = subprocess.run(
        [sys.executable, "-c", "import specrouter; print(specrouter.__file__)"],
        cwd=REPO, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
        check=True).stdout.strip()
    assert Path(plain).resolve() == (REPO / "specrouter" / "__init__.py").resolve()


def test_a_short_comparison_measures_every_variant() -> None:
    args = argparse.Namespace(connections=4, chunks=2, span_ms=20.0, rounds=1, seconds=1.0,
                              think_s=0.02, seed=7, json=None)
    result = ab.compare([ab.parse_variant("default="), ab.parse_variant("floor-asgi")], args)
    for name in ("default", "floor-asgi"):
        figures = result["variants"][name]
        assert figures["requests"] > 0 and figures["cpu_us"] > 0
        assert len(figures["cpu_us_by_round"]) == 1
        assert figures["ttft_p50_ms"] > 0  # nan (no settled request) fails too
    assert ab.lines(result)[2].startswith("| default |")
