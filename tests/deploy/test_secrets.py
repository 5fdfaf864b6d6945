"""Secrets in the chart and the compose stack: API keys and Redis passwords only in Secrets
(referenced, never inlined in a manifest), the bundled Redis behind a password and a
NetworkPolicy, and no usable admin token shipped in .env.example."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from specrouter.config import Settings, load_settings
from tests.deploy.test_compose import COMPOSE_DIR, env_example, interpolate
from tests.deploy.test_helm import by_kind, one, render

ROOT = Path(__file__).resolve().parents[2]
KEYED = {"router": {"extraBackends": [
    {"name": "e0", "url": "http://10.0.0.5:30000", "pool": "eagle", "group": "gpu9",
     "api_key": "sk-extra-backend-key-0001"},
    {"name": "b0", "url": "http://10.0.0.5:30001", "pool": "baseline", "group": "gpu9"}]}}
EXTERNAL_WITH_PASSWORD = {"redis": {"bundled": False,
                                    "externalUrl": "rediss://app:hunter2-pw@redis.infra:6380/1"}}


def router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment", "sr-specrouter-router")["spec"]["template"]["spec"]
    container: dict[str, Any] = pod["containers"][0]
    return container


def secret_value(docs: list[dict[str, Any]], name: str, key: str) -> str:
    return base64.b64decode(one(docs, "Secret", name)["data"][key]).decode()


def resolved_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secretKeyRef read from the
    rendered Secrets, $(VAR) expanded from the entries before it."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secret_value(docs, ref["name"], ref["key"])
        else:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                                        entry["value"])
    return env


def effective_settings(docs: list[dict[str, Any]], tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> Settings:
    config = tmp_path / "specrouter.yaml"
    config.write_text(one(docs, "ConfigMap", "sr-specrouter-router")["data"]["specrouter.yaml"])
    for name, value in resolved_env(docs, router_container(docs)).items():
        if name.startswith("SPECROUTER_"):
            monkeypatch.setenv(name, value)
    return load_settings(config)


def test_backend_api_keys_go_to_a_secret_not_the_configmap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(KEYED)
    for cm in by_kind(docs, "ConfigMap"):
        assert "sk-extra-backend-key-0001" not in json.dumps(cm)
    assert "sk-extra-backend-key-0001" not in json.dumps(router_container(docs))
    env = {e["name"]: e for e in router_container(docs)["env"]}
    ref = env["SPECROUTER_BACKENDS"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "sr-specrouter-backends"
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", "x" * 32)
    settings = effective_settings(docs, tmp_path, monkeypatch)
    keys = {b.name: b.api_key.get_secret_value() if b.api_key else None for b in settings.backends}
    assert keys == {"e0": "sk-extra-backend-key-0001", "b0": None,
                    "gpu0-eagle": None, "gpu0-baseline": None}  # the engines' servers too


def test_backends_without_keys_stay_in_the_configmap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({})
    assert "SPECROUTER_BACKENDS" not in {e["name"] for e in router_container(docs)["env"]}
    assert not [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-backends")]
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", "x" * 32)
    names = [b.name for b in effective_settings(docs, tmp_path, monkeypatch).backends]
    assert names == ["gpu0-eagle", "gpu0-baseline"]


def test_external_redis_password_comes_from_a_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(EXTERNAL_WITH_PASSWORD)
    rendered = json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert "hunter2-pw" not in rendered
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", "x" * 32)
    settings = effective_settings(docs, tmp_path, monkeypatch)
    assert settings.redis_url is not None
    assert settings.redis_url.get_secret_value() == "rediss://app:hunter2-pw@redis.infra:6380/1"


def test_external_redis_url_from_an_existing_secret() -> None:
    docs = render({"redis": {"bundled": False,
                             "externalUrlSecret": {"name": "ops-redis", "key": "url"}}})
    env = {e["name"]: e for e in router_container(docs)["env"]}
    assert env["SPECROUTER_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "ops-redis",
                                                                        "key": "url"}
    assert not [s for s in by_kind(docs, "Secret") if "redis" in s["metadata"]["name"]]


def test_bundled_redis_requires_the_generated_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({})
    password = secret_value(docs, "sr-specrouter-redis", "redis-password")
    assert len(password) >= 32 and password != secret_value(render({}), "sr-specrouter-redis",
                                                            "redis-password")  # random
    redis = one(docs, "Deployment", "sr-specrouter-redis")["spec"]["template"]["spec"][
        "containers"][0]
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    redis_env = resolved_env(docs, redis)
    assert redis_env["REDIS_PASSWORD"] == redis_env["REDISCLI_AUTH"] == password  # probe auth
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", "x" * 32)
    settings = effective_settings(docs, tmp_path, monkeypatch)
    assert settings.redis_url is not None
    assert settings.redis_url.get_secret_value() == (
        f"redis://:{password}@sr-specrouter-redis:6379/0")
    given = render({"redis": {"password": "given-pass-123"}})
    assert secret_value(given, "sr-specrouter-redis", "redis-password") == "given-pass-123"


def test_only_router_pods_reach_the_bundled_redis() -> None:
    docs = render({})
    (policy,) = by_kind(docs, "NetworkPolicy")
    spec = policy["spec"]
    redis_pod = one(docs, "Deployment", "sr-specrouter-redis")["spec"]["template"]["metadata"]
    router_pod = one(docs, "Deployment", "sr-specrouter-router")["spec"]["template"]["metadata"]
    assert spec["podSelector"]["matchLabels"].items() <= redis_pod["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= router_pod["labels"].items()
    engine_pod = one(docs, "StatefulSet", "sr-specrouter-engine")["spec"]["template"]["metadata"]
    assert not source["podSelector"]["matchLabels"].items() <= engine_pod["labels"].items()
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    assert not by_kind(render({"redis": {"networkPolicy": {"enabled": False}}}), "NetworkPolicy")


def test_env_example_ships_no_admin_token_and_compose_refuses_to_start_without_one() -> None:
    assert "SPECROUTER_ADMIN_TOKEN" not in env_example()
    assert "change-me" not in (COMPOSE_DIR / ".env.example").read_text()
    with pytest.raises(ValueError, match="SPECROUTER_ADMIN_TOKEN"):
        interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(), env_example())


def test_the_documented_command_writes_a_random_token_into_env(tmp_path: Path) -> None:
    docs = (ROOT / "docs" / "deploy.md").read_text()
    (command,) = {line.strip() for line in docs.splitlines()
                  if "openssl rand -hex 32" in line and ">> .env" in line}
    for _ in range(2):
        subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, timeout=10)
    tokens = [line.split("=", 1)[1] for line in (tmp_path / ".env").read_text().splitlines()]
    assert len(tokens) == 2 and tokens[0] != tokens[1]
    assert all(re.fullmatch(r"[0-9a-f]{64}", t) for t in tokens)
    env = {**env_example(), "SPECROUTER_ADMIN_TOKEN": tokens[0], "GRAFANA_ADMIN_PASSWORD": "g" * 32}
    compose = yaml.safe_load(interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(), env))
    assert compose["services"]["router"]["environment"]["SPECROUTER_ADMIN_TOKEN"] == tokens[0]
