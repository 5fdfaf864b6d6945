"""Configuration: precedence of sources and the start-up validation messages."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from specrouter.config import ConfigError, load_settings, parse_backend_spec
from tests.fixtures.procs import REPO_ROOT, specrouter_argv

E0 = {"name": "e0", "url": "http://127.0.0.1:30000", "pool": "eagle", "group": "gpu0"}
B0 = {"name": "b0", "url": "http://127.0.0.1:30001", "pool": "baseline", "group": "gpu0"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("SPECROUTER_"):
            monkeypatch.delenv(key)


def _load(**overrides: Any) -> Any:
    return load_settings(overrides=overrides)


def test_defaults() -> None:
    s = _load(backends=[E0, B0])
    assert (s.listen.host, s.listen.port, s.listen.access_log) == ("127.0.0.1", 8000, False)
    assert s.limits.max_body_bytes == 32 * 1024 * 1024
    assert s.group_names() == ["gpu0"]
    assert s.backends[0].url == "http://127.0.0.1:30000"


@pytest.mark.parametrize(
    ("backends", "extra", "message"),
    [
        ([], {}, "no backends configured"),
        ([E0, {**B0, "name": "e0"}], {}, "duplicate backend name: e0"),
        ([E0, {**B0, "url": E0["url"]}], {}, "duplicate backend url"),
        ([{**E0, "url": "127.0.0.1:30000"}], {},
         "backends.0.url: '127.0.0.1:30000' is not an http(s) URL"),
        ([{**E0, "url": "http://h:99999"}], {}, "backends.0.url: 'http://h:99999' has a bad port"),
        ([{**E0, "pool": "fast"}], {}, "backends.0.pool: Input should be 'eagle' or 'baseline'"),
        ([{**E0, "group": ""}], {}, "backends.0.group"),
        ([{**E0, "name": "a b"}], {}, "'a b' is not a valid name"),
        ([E0], {"groups": ["gpu0", "gpu1"]}, "group(s) with no server: gpu1"),
        ([E0, {**B0, "group": "gpu9"}], {"groups": ["gpu0"]}, "b0 name a group that is not in"),
        ([{**E0, "colour": "red"}], {}, "backends.0.colour: Extra inputs are not permitted"),
        ([E0], {"limits": {"max_body_bytes": 0}}, "limits.max_body_bytes"),
    ],
)
def test_validation_messages(backends: list[Any], extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(backends=backends, **extra)
    assert message in str(info.value)


def test_api_key_is_secret_in_repr_and_errors() -> None:
    s = _load(backends=[{**E0, "api_key": "sk-hunter2"}])
    assert "hunter2" not in repr(s)
    assert s.backends[0].api_key is not None
    assert s.backends[0].api_key.get_secret_value() == "sk-hunter2"
    with pytest.raises(ConfigError) as info:
        parse_backend_spec("name=e0,url=http://h:1,pool=eagle,api_key=sk-hunter2")
    assert "missing group" in str(info.value) and "hunter2" not in str(info.value)


def test_precedence_cli_over_env_over_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "listen: {port: 9000, host: 0.0.0.0}\n"
        "timeouts: {connect: 9, total: 5}\n"
        "backends:\n"
        "  - {name: f0, url: 'http://10.0.0.1:1', pool: eagle, group: g}\n"
    )
    s = load_settings(config)
    assert (s.listen.port, s.timeouts.connect, s.backends[0].name) == (9000, 9.0, "f0")
    monkeypatch.setenv("SPECROUTER_TIMEOUTS__CONNECT", "2")
    monkeypatch.setenv("SPECROUTER_LISTEN__PORT", "9100")
    s = load_settings(config)
    assert (s.listen.port, s.timeouts.connect, s.timeouts.total) == (9100, 2.0, 5.0)
    assert s.listen.host == "0.0.0.0"  # nested sections merge, not replace
    s = load_settings(config, {"listen": {"port": 1234}, "backends": [E0]})
    assert (s.listen.port, s.backends[0].name) == (1234, "e0")


def test_toml_file_and_env_config_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "router.toml"
    config.write_text(
        '[[backends]]\nname = "t0"\nurl = "http://127.0.0.1:5"\npool = "baseline"\ngroup = "g"\n'
    )
    monkeypatch.setenv("SPECROUTER_CONFIG", str(config))
    assert load_settings().backends[0].name == "t0"


def test_bad_config_path_and_typo_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"use a \.yaml, \.yml or \.toml file"):
        load_settings(tmp_path / "router.ini")
    typo = tmp_path / "typo.yaml"
    typo.write_text("listn: {port: 1}\nbackends: []\n")
    with pytest.raises(ConfigError, match="listn: Extra inputs are not permitted"):
        load_settings(typo)


def test_backend_spec_parsing() -> None:
    assert parse_backend_spec("name=e0,url=http://h:1,pool=eagle,group=g") == {
        "name": "e0", "url": "http://h:1", "pool": "eagle", "group": "g",
    }
    for bad in ("name=e0", "e0,http://h:1", "name=a,name=b,url=u,pool=eagle,group=g",
                "name=a,url=u,pool=eagle,group=g,colour=red"):
        with pytest.raises(ConfigError):
            parse_backend_spec(bad)


def test_serve_refuses_a_bad_config_with_a_clear_message() -> None:
    """The real CLI: exit status 2 and one readable line per problem, no traceback."""
    result = subprocess.run(
        specrouter_argv("serve", "--backend", "name=e0,url=ftp://x,pool=eagle,group=g",
                        "--backend", "name=e0,url=http://h:1,pool=turbo,group=g"),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "backends.0.url: 'ftp://x' is not an http(s) URL" in result.stderr
    assert "backends.1.pool: Input should be 'eagle' or 'baseline'" in result.stderr
    assert "Traceback" not in result.stderr
