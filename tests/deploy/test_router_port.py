"""The router's effective configuration in a pod: the image's ENV and CMD, the container's
env and args and the mounted ConfigMap, loaded the way `specrouter serve` loads them."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from specrouter.commands.serve import add_arguments, overrides_from_args
from specrouter.config import Settings, load_settings
from tests.deploy.test_compose import ADMIN_TOKEN
from tests.deploy.test_helm import one, render

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "Dockerfile"


def image_env() -> dict[str, str]:
    """ENV of the router image's final stage (KEY=VALUE pairs, continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    final = text.split("\nFROM ")[-1]
    env: dict[str, str] = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            env.update(pair.split("=", 1) for pair in line[4:].split())
    return env


def image_cmd() -> list[str]:
    (cmd,) = [line[4:] for line in DOCKERFILE.read_text().splitlines() if line.startswith("CMD ")]
    parsed: list[str] = json.loads(cmd)
    return parsed


def pod_settings(values: dict[str, Any], tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> tuple[Settings, dict[str, Any]]:
    docs = render(values)
    container = one(docs, "Deployment", "sr-specrouter-router")["spec"]["template"]["spec"][
        "containers"][0]
    config = one(docs, "ConfigMap", "sr-specrouter-router")["data"]["specrouter.yaml"]
    mounted = tmp_path / "specrouter.yaml"
    mounted.write_text(config)
    env = dict(image_env())
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    env["SPECROUTER_ADMIN_TOKEN"] = ADMIN_TOKEN  # from the Secret
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Kubernetes' args replace the image's CMD; the ENTRYPOINT is `specrouter serve`.
    argv = [a.replace("/etc/specrouter/specrouter.yaml", str(mounted))
            for a in container.get("args", image_cmd())]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    return load_settings(args.config, overrides_from_args(args)), container


def test_the_image_sets_no_router_setting_that_would_beat_the_config_file() -> None:
    assert not [k for k in image_env() if k.startswith("SPECROUTER_")]
    assert image_cmd() == ["--host", "0.0.0.0"]


@pytest.mark.parametrize("port", [8000, 9100])
def test_router_port_from_values_is_the_port_the_router_listens_on(
        port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings, container = pod_settings({"router": {"port": port}}, tmp_path, monkeypatch)
    assert settings.listen.port == port
    assert settings.listen.host == "0.0.0.0"
    (http,) = container["ports"]
    assert http["containerPort"] == port and http["name"] == "http"
    assert container["readinessProbe"]["httpGet"]["port"] == "http"


def test_an_env_port_still_beats_the_file_so_the_image_must_not_set_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The precedence this chart relies on: were the image to set the port, it would win.
    monkeypatch.setenv("SPECROUTER_LISTEN__PORT", "8000")
    (tmp_path / "c.yaml").write_text(
        "listen: {port: 9100}\nbackends:\n"
        "  - {name: e, url: 'http://e:1', pool: eagle, group: g}\n"
        "  - {name: b, url: 'http://b:1', pool: baseline, group: g}\n")
    assert load_settings(tmp_path / "c.yaml").listen.port == 8000
