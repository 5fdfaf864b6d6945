"""The Grafana dashboard: valid JSON that Grafana's provisioning and the chart's sidecar
ConfigMap both carry, and every PromQL query names only series a running router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest import loopback
from tests.deploy.test_compose import COMPOSE_DIR, raw_compose
from tests.deploy.test_helm import KUBE_VERSION, by_kind, render
from tests.fixtures.redis import RedisServer
from tests.fixtures.router import RouterFactory

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "specrouter.json"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "summary": ("_sum", "_count", "")}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def queries(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers outside label matchers and strings."""
    bare = re.sub(r"\{[^}]*\}", "", re.sub(r'"[^"]*"', "", expr))
    return set(re.findall(r"\bspecrouter_[a-zA-Z0-9_:]*", bare))


def filtered_labels(expr: str) -> dict[str, set[str]]:
    """The label names each series of a PromQL expression is filtered on (`name{label=...}`)."""
    out: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"\b(specrouter_[a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        bare = re.sub(r'"[^"]*"', '""', matchers)
        out.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", bare))
    return out


def exported_labels(exposition: str) -> dict[str, set[str]]:
    """The label names the samples of each sample name carry in a scrape."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def exported_names(exposition: str) -> set[str]:
    """The sample names a scrape can hold: every family's samples, and for a declared family
    with no sample yet (a labelled counter before its first event), the names of its type."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def test_dashboard_is_grafana_json_with_unique_panels_on_the_datasource_variable() -> None:
    dash = dashboard()
    assert dash["uid"] == "specrouter" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert metric_names(target["expr"]), target["expr"]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("pool", "reason", "load", "accept length", "time to first token",
                  "end-to-end", "breaker", "telemetry age", "store"):
        assert topic in titles, topic


def test_every_query_names_a_series_a_running_router_exports(
        redis_server: RedisServer, sim_group: Any, router: RouterFactory) -> None:
    group = sim_group(time_scale=0.02)
    backends = [{"name": f"gpu0-{pool}", "url": group.url(pool), "pool": pool, "group": "gpu0"}
                for pool in ("eagle", "baseline")]
    proc = router(backends, env={"SPECROUTER_REDIS_URL": redis_server.url()})
    with openai.OpenAI(base_url=proc.v1, api_key="none", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
        assert [chunk for chunk in stream]
    exposition = loopback.get(f"{proc.url}/metrics", timeout=5.0).text
    exported = exported_names(exposition)
    assert "specrouter_time_to_first_token_seconds_bucket" in exported
    used = set().union(*(metric_names(q) for q in queries(dashboard())))
    assert used - exported == set()
    # a label a panel filters on (the $group selection) is one the series carries
    labels = exported_labels(exposition)
    assert {"pool", "reason", "group"} <= labels["specrouter_decisions_total"]
    for query in queries(dashboard()):
        for name, filtered in filtered_labels(query).items():
            if name in labels:
                assert filtered <= labels[name], (query, filtered - labels[name])
    # the dashboard covers the router's families, the state store's included
    assert {"specrouter_group_pool", "specrouter_decisions_total", "specrouter_state_connected",
            "specrouter_breaker_state", "specrouter_telemetry_age_seconds"} <= used


def test_the_label_check_bites() -> None:
    expr = 'sum by (group) (rate(specrouter_decisions_total{group=~"$group",pool="a=b"}[5m]))'
    assert filtered_labels(expr) == {"specrouter_decisions_total": {"group", "pool"}}
    scrape = ("# TYPE specrouter_decisions counter\n# HELP specrouter_decisions x\n"
              'specrouter_decisions_total{pool="eagle",reason="low_load"} 1.0\n')
    assert exported_labels(scrape)["specrouter_decisions_total"] == {"pool", "reason"}


def test_the_name_check_bites() -> None:
    assert metric_names('sum by (pool) (rate(specrouter_requestz_total{pool="eagle"}[5m]))') == {
        "specrouter_requestz_total"}
    assert "specrouter_requestz_total" not in exported_names(
        "# TYPE specrouter_requests counter\n# HELP specrouter_requests x\n")


def test_chart_offers_the_same_dashboard_to_the_grafana_sidecar() -> None:
    assert not [c for c in by_kind(render({}), "ConfigMap")
                if c["metadata"]["name"].endswith("-dashboard")]
    docs = render({"grafanaDashboard": {"enabled": True,
                                        "annotations": {"grafana_folder": "LLM"}}})
    (cm,) = [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["specrouter.json"]) == dashboard()
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)


def test_compose_provisions_prometheus_and_the_dashboard_in_grafana() -> None:
    grafana = raw_compose()["services"]["grafana"]
    mounts = {m.split(":")[1]: (COMPOSE_DIR / m.split(":")[0]).resolve()
              for m in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "prometheus" in raw_compose()["services"]
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "specrouter.yaml").read_text())["providers"]
    dashboards_dir = provider["options"]["path"]
    assert mounts[f"{dashboards_dir}/specrouter.json"] == DASHBOARD.resolve()
    assert grafana["ports"][0].startswith("127.0.0.1:")
    assert "GRAFANA_ADMIN_PASSWORD:?" in grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
