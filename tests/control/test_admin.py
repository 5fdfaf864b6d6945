"""AdminApi in process: the policy history route and the 422 summary."""

from __future__ import annotations

import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.testclient import TestClient

from specrouter.control.admin import AdminApi
from specrouter.control.holder import LocalPolicyHolder
from specrouter.routing.policy import Policy

TOKEN = "admin-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _client() -> TestClient:
    api = AdminApi(LocalPolicyHolder(Policy()), None, SecretStr(TOKEN))
    return TestClient(Starlette(routes=api.routes()))


def test_history_lists_accepted_changes_newest_first_without_a_token() -> None:
    client = _client()
    assert client.get("/policy/history").json() == {"history": []}
    assert client.patch("/policy", json={"switch_up": 20}, headers=AUTH).status_code == 200
    assert client.put("/policy", json={"mode": "eagle"}, headers=AUTH).status_code == 200
    assert client.patch("/policy", json={"mode": "nope"}, headers=AUTH).status_code == 422

    history = client.get("/policy/history").json()["history"]
    assert [(h["kind"], h["old"]["version"], h["new"]["version"]) for h in history] == [
        ("put", 2, 3), ("patch", 1, 2)]
    assert history[1]["new"]["switch_up"] == 20 and history[0]["new"]["mode"] == "eagle"
    assert history[0]["actor"] and history[0]["at"]


def test_history_is_read_only() -> None:
    assert _client().post("/policy/history", json={}, headers=AUTH).status_code == 405


def test_an_invalid_write_names_each_field_in_the_message() -> None:
    refused = _client().patch("/policy", json={"switch_up": 4, "switch_down": 9, "mode": "x"},
                              headers=AUTH)
    error = refused.json()["error"]
    assert refused.status_code == 422 and error["param"] in {"mode", "switch_down"}
    assert "mode: " in error["message"] and "Value error, " not in error["message"]


@pytest.mark.parametrize("raw", [
    b'{"switch_up": Infinity}', b'{"switch_up": -Infinity}', b'{"switch_up": NaN}',
    b'{"switch_up": 1e400}', b'{"switch_up": -1e400}',
    b'{"x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
    b'{"switch_up": ' + b'{"a": ' * 20 + b"1" + b"}" * 20 + b"}",
], ids=["Infinity", "-Infinity", "NaN", "1e400", "-1e400", "deep-nesting", "nested-20"])
def test_non_finite_numbers_and_deep_nesting_are_400_in_openai_format(raw: bytes) -> None:
    client = TestClient(_client().app, raise_server_exceptions=False)
    for method in ("PUT", "PATCH"):
        answer = client.request(method, "/policy", content=raw,
                                headers={**AUTH, "content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
    assert client.get("/policy").json()["policy"]["version"] == 1  # nothing written
