"""`/policy` (GET/PUT/PATCH, validation, auth) and `/metrics` of a running router."""

from __future__ import annotations

import openai
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from tests.fixtures.procs import wait_until
from tests.fixtures.router import RouterFactory
from tests.integration.conftest import ADMIN_TOKEN, ClusterFactory, backend_name

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def test_policy_get_put_patch_and_validation(cluster: ClusterFactory) -> None:
    c = cluster(policy={"strategy": "threshold", "switch_up": 10, "switch_down": 5})
    view = c.policy()
    assert view["policy"]["version"] == 1 and view["policy"]["switch_up"] == 10
    assert view["policy"]["updated_at"]
    assert [g["group"] for g in view["groups"]] == ["gpu0", "gpu1"]
    for group in view["groups"]:
        assert group["load"] == 0 and group["choice"] == "eagle"
        assert group["reason"] == "below_switch_down"
    backend = next(b for b in view["backends"] if b["name"] == "gpu0-eagle")
    assert backend["healthy"] is True and backend["breaker"] == "closed"
    assert backend["inflight"] == 0 and backend["telemetry"]["age_s"] < 1.0
    assert backend["telemetry"]["source"] == "v1_loads"

    patched = c.write_policy("PATCH", {"switch_up": 6})
    assert patched.status_code == 200
    assert (patched.json()["policy"]["version"], patched.json()["policy"]["switch_up"],
            patched.json()["policy"]["switch_down"]) == (2, 6, 5)

    put = c.write_policy("PUT", {"strategy": "overflow", "eagle_cap": 3})
    assert put.status_code == 200
    policy = c.policy()["policy"]
    # PUT replaces: fields not given are back to their defaults.
    assert (policy["version"], policy["strategy"], policy["eagle_cap"], policy["switch_up"]) == (
        3, "overflow", 3, 16)

    history = loopback.get(f"{c.url}/policy/history", timeout=5.0).json()["history"]
    assert [(h["kind"], h["old"]["version"], h["new"]["version"]) for h in history] == [
        ("put", 2, 3), ("patch", 1, 2)]

    for bad, field in (({"switch_up": 4, "switch_down": 9}, "switch_down"),
                       ({"mode": "fastest"}, "mode"), ({"colour": "blue"}, "colour")):
        refused = c.write_policy("PATCH", bad)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == 422 and error["errors"][0]["loc"] == [field]
    assert c.policy()["policy"]["version"] == 3  # the old policy stays in force

    not_json = loopback.patch(f"{c.url}/policy", content=b"{nope",
                           headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5.0)
    assert not_json.status_code == 400
    huge = c.write_policy("PUT", {"mode": "auto", "pad": "x" * 100_000})
    assert huge.status_code == 413

    # The change log names old and new policy; the token never appears in the output.
    output = c.router.process.output()
    assert "policy changed (patch" in output and '"switch_up":6.0' in output
    assert ADMIN_TOKEN not in output


def test_policy_writes_need_the_admin_token(cluster: ClusterFactory,
                                            router: RouterFactory) -> None:
    c = cluster()
    missing = loopback.patch(f"{c.url}/policy", json={"mode": "baseline"}, timeout=5.0)
    wrong = c.write_policy("PATCH", {"mode": "baseline"}, token="wrong-token")
    for response in (missing, wrong):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
    assert c.policy()["policy"]["mode"] == "auto"
    assert c.router.process.output().count("wrong-token") == 0

    # A router with no admin token refuses every write, even one with a token.
    backends = [{"name": backend_name(g, p), "url": sim.url(p), "pool": p, "group": g}
                for g, sim in c.groups.items() for p in ("eagle", "baseline")]
    locked = router(backends)
    refused = loopback.patch(f"{locked.url}/policy", json={"mode": "baseline"},
                          headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5.0)
    assert refused.status_code == 403
    assert "no admin token" in refused.json()["error"]["message"]
    assert loopback.get(f"{locked.url}/policy", timeout=5.0).json()["policy"]["mode"] == "auto"


def _families(url: str) -> dict[str, object]:
    text = loopback.get(f"{url}/metrics", timeout=5.0).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _requests_done(url: str) -> float:
    family = _families(url).get("specrouter_requests")
    return sum(s.value for s in getattr(family, "samples", ()) if s.name.endswith("_total"))


def test_metrics_exposition_has_the_series(cluster: ClusterFactory) -> None:
    c = cluster()
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)
    # The pools are forced; each answer's headers say where it went and why (a pool that
    # failed its health checks on a busy host is avoided even when forced), and the series
    # must count exactly that.
    routed: list[tuple[str, str]] = []
    c.patch(mode="eagle")
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
        routed.append((raw.headers["x-specrouter-pool"], raw.headers["x-specrouter-reason"]))
        assert "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    c.patch(mode="baseline")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4)
    routed.append((raw.headers["x-specrouter-pool"], raw.headers["x-specrouter-reason"]))
    assert raw.parse().choices[0].message.content
    assert routed.count(("eagle", "forced_mode")) + routed.count(("baseline", "eagle_unhealthy")) \
        == 3, routed
    assert routed[3] in (("baseline", "forced_mode"), ("eagle", "baseline_unhealthy")), routed
    # a request is counted once its last byte left, which the client may read first
    wait_until(lambda: _requests_done(c.url) == 4, 5.0, "4 requests counted")
    families = _families(c.url)
    for name in ("specrouter_requests", "specrouter_decisions", "specrouter_upstream_errors",
                 "specrouter_time_to_first_token_seconds",
                 "specrouter_e2e_request_latency_seconds", "specrouter_inflight_requests",
                 "specrouter_group_load", "specrouter_breaker_state", "specrouter_policy_version",
                 "specrouter_telemetry_age_seconds", "specrouter_telemetry_stale_reads",
                 "specrouter_backend_healthy"):
        assert name in families, name

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for s in families[name].samples]  # type: ignore[attr-defined]

    ok: dict[tuple[str, str], float] = {}
    for n, lbl, v in samples("specrouter_requests"):
        if n.endswith("_total"):  # summed over the backends of each pool
            ok[lbl["pool"], lbl["status"]] = ok.get((lbl["pool"], lbl["status"]), 0) + v
    pools = [pool for pool, _ in routed]
    assert {k: v for k, v in ok.items() if v} == {(p, "200"): pools.count(p) for p in set(pools)}
    decided: dict[tuple[str, str], float] = {}  # summed over the groups
    for n, lbl, v in samples("specrouter_decisions"):
        if n.endswith("_total"):
            assert lbl["group"] in ("gpu0", "gpu1")
            decided[lbl["pool"], lbl["reason"]] = decided.get((lbl["pool"], lbl["reason"]), 0) + v
    assert {k: v for k, v in decided.items() if v} == {k: routed.count(k) for k in set(routed)}
    ttft = {lbl["pool"]: v for n, lbl, v in samples("specrouter_time_to_first_token_seconds")
            if n.endswith("_count") and v}  # the three streams
    assert ttft == {p: pools[:3].count(p) for p in set(pools[:3])}
    e2e = [v for n, lbl, v in samples("specrouter_e2e_request_latency_seconds")
           if n.endswith("_count")]
    assert sum(e2e) == 4
    version = [v for _, _, v in samples("specrouter_policy_version")]
    assert version == [3]
    ages = {lbl["backend"]: v for _, lbl, v in samples("specrouter_telemetry_age_seconds")}
    assert set(ages) == {"gpu0-eagle", "gpu0-baseline", "gpu1-eagle", "gpu1-baseline"}
    assert all(age < 1.0 for age in ages.values())
