"""Light checks of the engine image recipe (no Docker engine here to build it): a pinned
SGLang base, specrouter installed under SGLang's frozen versions, `pip check`, launch-pair."""

from __future__ import annotations

import re
from pathlib import Path

TEXT = (Path(__file__).resolve().parents[2] / "deploy" / "docker" / "engine.Dockerfile"
        ).read_text()
JOINED = re.sub(r"\\\n", " ", TEXT)


def instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in JOINED.splitlines()
            if line.split(None, 1)[:1] == [name]]


def test_sglang_base_is_pinned_to_a_release() -> None:
    (arg,) = [a for a in instructions("ARG") if a.startswith("SGLANG_IMAGE=")]
    image = arg.split("=", 1)[1]
    repo, _, tag = image.partition(":")
    assert repo == "lmsysorg/sglang"
    assert re.fullmatch(r"v\d+\.\d+\.\d+(\.post\d+)?(-cu\d+)?(@sha256:[0-9a-f]{64})?", tag), tag
    assert instructions("FROM")[-1] == "${SGLANG_IMAGE}"


def test_specrouter_installs_under_sglangs_frozen_versions_then_pip_check() -> None:
    (run,) = [r for r in instructions("RUN") if "specrouter-" in r]
    freeze = run.index("pip list --format=freeze > /tmp/sglang-frozen.txt")
    install = run.index("pip install --no-cache-dir --constraint /tmp/sglang-frozen.txt")
    check = run.index("pip check")
    assert freeze < install < check
    assert "&&" in run and ";" not in run  # any failing step fails the build


def test_the_image_runs_launch_pair() -> None:
    assert instructions("ENTRYPOINT") == ['["specrouter", "launch-pair"]']
