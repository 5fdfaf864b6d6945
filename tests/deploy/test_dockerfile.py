"""Light checks of the router image recipe (no Docker engine here to build it)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
TEXT = (DOCKER / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", TEXT)
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.split(None, 1)[:1] == [name]]


def test_multi_stage_slim_base() -> None:
    froms = instructions("FROM")
    assert len(froms) == 2
    assert all(f.startswith("python:3.11-slim") for f in froms)
    assert "--from=build" in TEXT or "from=build" in TEXT


def test_runs_as_non_root_with_a_health_check_on_health() -> None:
    (user,) = instructions("USER")
    assert user.split(":")[0] not in ("root", "0")
    (health,) = instructions("HEALTHCHECK")
    assert "/health" in health and "--interval" in health
    assert instructions("ENTRYPOINT") == ['["specrouter", "serve"]']


def test_dockerignore_keeps_what_copy_needs() -> None:
    patterns = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    def ignored(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            if fnmatch.fnmatch(path, pattern.lstrip("!").rstrip("/")) or path.startswith(
                    pattern.lstrip("!")):
                verdict = not negate
        return verdict
    for copied in ("pyproject.toml", "README.md", "specrouter/"):
        assert not ignored(copied), copied
    for junk in (".venv", "tests", ".git"):
        assert ignored(junk), junk
