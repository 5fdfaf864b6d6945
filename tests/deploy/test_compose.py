"""The compose stack: valid under the Compose Specification, and wired the way the pair needs.

compose-spec.json is vendored from github.com/compose-spec/compose-spec,
schema/compose-spec.json at commit a08f8d51631b7127ddac3d2c65537db429d0f1d0 (Apache-2.0);
no PyPI package ships it (`compose-spec` on PyPI is Rust bindings, not the schema).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from specrouter.commands.descriptors import plan_budget
from specrouter.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
SCHEMA = json.loads(Path(__file__).with_name("compose-spec.json").read_text())
#: An admin token the router accepts (random hex, like `openssl rand -hex 16`).
ADMIN_TOKEN = "3f9a1c7e5b2d8e4f6a0c1b9d7e3a5f2c"
_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def raw_compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    return data


def env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (COMPOSE_DIR / ".env.example").read_text().splitlines()
             if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ rules, enough for this file."""
    def sub(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name is None:  # `$$`: a literal `$` for the container's shell
            return "$"
        value = env.get(name, "")
        if op and op.endswith("-") and not value:
            return arg
        if op and op.endswith("?") and not value:
            raise ValueError(f"{name}: {arg}")
        return value
    return _VAR.sub(sub, text)


def compose_with_env() -> dict[str, Any]:
    # .env.example ships no admin token: the operator appends a random one (docs/deploy.md)
    env = {**env_example(), "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
           "GRAFANA_ADMIN_PASSWORD": "e" * 32, "REDIS_PASSWORD": "d" * 64}
    text = interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(), env)
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def validate(doc: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(doc)


def test_compose_file_is_valid_under_the_compose_spec() -> None:
    validate(raw_compose())
    validate(compose_with_env())


def test_the_schema_catches_mistakes() -> None:
    broken = copy.deepcopy(raw_compose())
    broken["services"]["router"]["depends_on"]["engines-gpu0"]["condition"] = "service_up"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = copy.deepcopy(raw_compose())
    broken["services"]["engines-gpu0"]["deploy"]["resources"]["reservations"]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


@pytest.mark.parametrize("secret", ["SPECROUTER_ADMIN_TOKEN", "GRAFANA_ADMIN_PASSWORD",
                                    "REDIS_PASSWORD"])
def test_a_missing_secret_is_an_error_not_an_empty_value(secret: str) -> None:
    env = {**env_example(), "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
           "GRAFANA_ADMIN_PASSWORD": "e" * 32, "REDIS_PASSWORD": "d" * 64}
    interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(), env)
    del env[secret]
    with pytest.raises(ValueError, match=f"{secret}: set {secret} in .env"):
        interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(), env)


def test_router_env_names_are_the_ones_the_router_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", "s3cret-token-for-test")
    monkeypatch.setenv("SPECROUTER_LISTEN__PORT", "8123")  # the Dockerfile's ENV
    settings = load_settings(COMPOSE_DIR / "specrouter.yaml", environ={})
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "s3cret-token-for-test"
    assert settings.listen.port == 8123


def test_the_router_gets_a_nofile_limit_that_holds_its_connections() -> None:
    nofile = raw_compose()["services"]["router"]["ulimits"]["nofile"]
    assert nofile["soft"] == nofile["hard"] >= 65536
    settings = load_settings(overrides={"backends": [
        {"name": "e", "url": "http://eagle:30000", "pool": "eagle", "group": "gpu0"},
        {"name": "b", "url": "http://baseline:30001", "pool": "baseline", "group": "gpu0"}]},
        environ={})
    assert not plan_budget(settings, nofile["soft"]).lowered  # the defaults fit unchanged


def _neighbours(doc: dict[str, Any], service: str) -> set[str]:
    """The other services that share a network with `service`."""
    mine = set(doc["services"][service]["networks"])
    return {name for name, spec in doc["services"].items()
            if name != service and mine & set(spec.get("networks", ()))}


def test_redis_and_the_engines_are_reachable_only_by_who_talks_to_them() -> None:
    doc = compose_with_env()
    validate(doc)
    assert all("networks" in spec for spec in doc["services"].values())
    assert doc["services"]["redis"]["networks"] == ["state"]
    assert doc["networks"]["state"] == {"internal": True}
    assert _neighbours(doc, "redis") == {"router"}
    assert _neighbours(doc, "engines-gpu0") == {"router", "prometheus"}
    assert _neighbours(doc, "grafana") == {"router", "prometheus"}
