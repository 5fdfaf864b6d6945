"""Secrets in the chart and the compose stack: API keys and Redis passwords only in Secrets
(referenced, never inlined in a manifest), the bundled Redis behind a password and a
NetworkPolicy, and no usable admin token shipped in .env.example."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from pydantic import ValidationError

from specrouter.config import ConfigError, Settings, load_settings, weak_admin_token
from tests.deploy.test_compose import ADMIN_TOKEN, COMPOSE_DIR, env_example, interpolate
from tests.deploy.test_helm import by_kind, one, render
from tests.fixtures.procs import free_port, wait_until
from tests.fixtures.redis import REDIS_SERVER

ROOT = Path(__file__).resolve().parents[2]
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
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
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
    settings = effective_settings(docs, tmp_path, monkeypatch)
    keys = {b.name: b.api_key.get_secret_value() if b.api_key else None for b in settings.backends}
    assert keys == {"e0": "sk-extra-backend-key-0001", "b0": None,
                    "gpu0-eagle": None, "gpu0-baseline": None}  # the engines' servers too


def test_backends_without_keys_stay_in_the_configmap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({})
    assert "SPECROUTER_BACKENDS" not in {e["name"] for e in router_container(docs)["env"]}
    assert not [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-backends")]
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
    names = [b.name for b in effective_settings(docs, tmp_path, monkeypatch).backends]
    assert names == ["gpu0-eagle", "gpu0-baseline"]


def test_external_redis_password_comes_from_a_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(EXTERNAL_WITH_PASSWORD)
    rendered = json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert "hunter2-pw" not in rendered
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
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
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
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
        interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(),
                    {**env_example(), "REDIS_PASSWORD": "d" * 64})


def documented_command(name: str) -> str:
    """The line of docs/deploy.md that appends a random `name` to .env."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    (command,) = {line.strip() for line in docs.splitlines()
                  if f'"{name}=$(openssl rand -hex 32)" >> .env' in line}
    return command


def test_the_documented_commands_write_random_secrets_into_env(tmp_path: Path) -> None:
    values = {}
    for name in ("SPECROUTER_ADMIN_TOKEN", "REDIS_PASSWORD"):
        for _ in range(2):
            subprocess.run(["bash", "-c", documented_command(name)], cwd=tmp_path, check=True,
                           timeout=10)
        written = [line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines()]
        tokens = [v for k, v in written if k == name]
        assert len(tokens) == 2 and tokens[0] != tokens[1]
        assert all(re.fullmatch(r"[0-9a-f]{64}", t) for t in tokens)  # URL-safe as it stands
        values[name] = tokens[0]
    env = {**env_example(), **values, "GRAFANA_ADMIN_PASSWORD": "g" * 32}
    compose = yaml.safe_load(interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(), env))
    router_env = compose["services"]["router"]["environment"]
    assert router_env["SPECROUTER_ADMIN_TOKEN"] == values["SPECROUTER_ADMIN_TOKEN"]
    assert router_env["SPECROUTER_REDIS_URL"] == (
        f"redis://:{values['REDIS_PASSWORD']}@redis:6379/0")


def test_env_example_ships_no_redis_password() -> None:
    assert "REDIS_PASSWORD" not in env_example()
    with pytest.raises(ValueError, match="REDIS_PASSWORD"):
        interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(),
                    {**env_example(), "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
                     "GRAFANA_ADMIN_PASSWORD": "e" * 32})


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _sh(command: str, env: dict[str, str]) -> int:
    return subprocess.run(["sh", "-c", command], env=env, capture_output=True,
                          timeout=10).returncode


def test_compose_redis_needs_the_password_its_healthcheck_and_the_router_have(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolved redis service run here: its command and environment as compose passes
    them, the image's entrypoint and redis-cli replaced by stubs on a loopback port."""
    password = secrets.token_hex(32)
    env = {**env_example(), "SPECROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
           "GRAFANA_ADMIN_PASSWORD": "e" * 32, "REDIS_PASSWORD": password}
    services = yaml.safe_load(interpolate((COMPOSE_DIR / "docker-compose.yml").read_text(),
                                          env))["services"]
    service = services["redis"]
    assert password not in json.dumps([service["command"], service["healthcheck"]])
    port = free_port()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "docker-entrypoint.sh",
          f'shift; exec {REDIS_SERVER} "$@" --port {port} --bind 127.0.0.1 --dir {tmp_path}')
    _stub(bin_dir, "redis-cli", f'exec {REDIS_CLI} -p {port} "$@"')
    container_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **service["environment"]}
    proc = subprocess.Popen(service["command"], env=container_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _sh(f"{REDIS_CLI} -p {port} ping", {}) == 0, timeout=20,
                   what="redis-server of the compose service")
        with redis.Redis(host="127.0.0.1", port=port) as anonymous, \
                pytest.raises(redis.RedisError, match=r"(?i)auth"):
            anonymous.ping()
        kind, check = service["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        assert _sh(check, container_env) == 0
        without = {k: v for k, v in container_env.items() if k != "REDISCLI_AUTH"}
        assert _sh(check, without) != 0  # NOAUTH: unhealthy, though redis-cli exits 0
        assert _sh(check, {**container_env, "REDISCLI_AUTH": "wrong"}) != 0
        url = services["router"]["environment"]["SPECROUTER_REDIS_URL"]
        monkeypatch.setenv("SPECROUTER_REDIS_URL", url.replace("@redis:6379", f"@127.0.0.1:{port}"))
        monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
        settings = load_settings(COMPOSE_DIR / "specrouter.yaml", environ={})
        assert settings.redis_url is not None
        assert password not in repr(settings)
        with redis.Redis.from_url(settings.redis_url.get_secret_value()) as client:
            assert client.ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


BACKENDS = [{"name": "e", "url": "http://127.0.0.1:1", "pool": "eagle", "group": "g"},
            {"name": "b", "url": "http://127.0.0.1:2", "pool": "baseline", "group": "g"}]
WEAK_TOKENS = ["change-me", "short-token-15c", "", "x" * 32, "abab" * 8,
               "CHANGE_ME-a1b2c3d4e5f6", "my-Password-7f3e9a2c"]


@pytest.mark.parametrize("token", WEAK_TOKENS)
def test_a_weak_admin_token_is_refused_without_quoting_it(
        token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", token)
    with pytest.raises(ConfigError, match="admin_token: refused") as refused:
        load_settings(overrides={"backends": BACKENDS}, environ={})
    assert "SPECROUTER_ALLOW_WEAK_ADMIN_TOKEN=1" in str(refused.value)
    with pytest.raises(ValidationError) as raw:
        Settings(backends=BACKENDS, admin_token=token)
    for message in (str(refused.value), str(raw.value)):
        assert not token or token not in message


@pytest.mark.parametrize("token", WEAK_TOKENS)
def test_the_insecure_flag_lets_a_demo_use_a_weak_token(
        token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECROUTER_ADMIN_TOKEN", token)
    monkeypatch.setenv("SPECROUTER_ALLOW_WEAK_ADMIN_TOKEN", "1")
    settings = load_settings(overrides={"backends": BACKENDS}, environ={})
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == token
    # serve logs a warning at start-up, without the token
    warning = settings.admin_token_warning
    if token:
        assert warning is not None and "allow_weak_admin_token" in warning
        assert token not in warning


def test_random_tokens_pass() -> None:
    for token in (ADMIN_TOKEN, secrets.token_hex(8), secrets.token_urlsafe(32)):
        assert weak_admin_token(token) is None
        assert Settings(backends=BACKENDS, admin_token=token).admin_token is not None
        assert Settings(backends=BACKENDS, admin_token=token,
                        allow_weak_admin_token=True).admin_token_warning is None
    assert Settings(backends=BACKENDS).admin_token is None  # no token: writes refused


def test_serve_refuses_to_start_with_a_weak_token_and_does_not_print_it() -> None:
    argv = [sys.executable, "-m", "specrouter", "serve", "--port", "0"]
    for b in BACKENDS:
        argv += ["--backend", ",".join(f"{k}={v}" for k, v in b.items())]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTER_")}
    done = subprocess.run(argv, env={**env, "SPECROUTER_ADMIN_TOKEN": "weak-tok-9"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "admin_token: refused, the token is shorter than 16 characters" in done.stderr
    assert "weak-tok-9" not in done.stdout + done.stderr
