"""The Helm chart, rendered by Helm's own engine (helm-python-sdk embeds Helm's Go SDK) and
every object validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
unknown fields are errors)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from specrouter.config import load_settings

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "specrouter"
KUBE_VERSION = "1.34.0"  # DRA (resource.k8s.io/v1) is GA from 1.34

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "dra-three-gpus-external-redis": {
        "engines": {"gpuSharing": "dra", "pairs": 3},
        "redis": {"bundled": False, "externalUrl": "redis://redis.infra:6379/2"},
        "serviceMonitor": {"enabled": True},
        "router": {"autoscaling": {"enabled": False}, "replicas": 3},
        "adminToken": {"existingSecret": "ops-admin-token"},
    },
    "router-only-external-engines": {
        "engines": {"enabled": False},
        "router": {"extraBackends": [
            {"name": "e0", "url": "http://10.0.0.5:30000", "pool": "eagle", "group": "gpu0"},
            {"name": "b0", "url": "http://10.0.0.5:30001", "pool": "baseline", "group": "gpu0"},
        ]},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(values)
    out = chart.render(values, name="sr", namespace="llm", is_install=True)
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_values_yaml_matches_values_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(values)


@pytest.mark.parametrize("bad", [
    {"engines": {"gpuSharing": "mps"}},
    {"engines": {"eagle": {"port": 0}}},
    {"redis": {"bundled": False}},
    {"router": {"replicaz": 2}},
])
def test_schema_refuses_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        helm.Chart.load(str(CHART)).validate_schema(bad)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_is_valid_kubernetes(variant: str) -> None:
    docs = render(VARIANTS[variant])
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            check_service_monitor(doc)  # a CRD: not in the core schemas
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def check_service_monitor(doc: dict[str, Any]) -> None:
    assert doc["kind"] == "ServiceMonitor" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["spec"]["selector"]["matchLabels"]
    assert all(ep["path"] == "/metrics" and ep["port"] for ep in doc["spec"]["endpoints"])


def test_the_validator_bites() -> None:
    deployment = copy.deepcopy(one(render({}), "Deployment", "sr-specrouter-router"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_router_probes_secret_and_redis() -> None:
    docs = render({})
    pod = one(docs, "Deployment", "sr-specrouter-router")["spec"]["template"]["spec"]
    router = pod["containers"][0]
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    env = {e["name"]: e for e in router["env"]}
    assert env["SPECROUTER_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@sr-specrouter-redis:6379/0"
    secret_ref = env["SPECROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"] == "sr-specrouter-admin"
    assert int(env["SPECROUTER_WORKERS"]["value"]) > 1
    secret = one(docs, "Secret", "sr-specrouter-admin")
    assert len(secret["data"]["admin-token"]) > 40  # random, base64, never empty
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {d["kind"] for d in docs} >= {"HorizontalPodAutoscaler", "PodDisruptionBudget"}
    assert one(docs, "Service", "sr-specrouter-redis")


def router_settings(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    config = one(docs, "ConfigMap", "sr-specrouter-router")["data"]["specrouter.yaml"]
    path = tmp_path / "specrouter.yaml"
    path.write_text(config)
    return load_settings(path, environ={})


def test_launch_pair_mode_one_container_one_gpu(tmp_path: Path) -> None:
    docs = render({})
    pod = one(docs, "StatefulSet", "sr-specrouter-engine")["spec"]["template"]["spec"]
    (pair,) = pod["containers"]
    assert pair["command"] == ["specrouter", "launch-pair"]
    assert pair["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(a.startswith("--eagle-kv-tokens=") for a in pair["args"])
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    settings = router_settings(docs, tmp_path)
    host = "sr-specrouter-engine-0.sr-specrouter-engine.llm.svc.cluster.local"
    assert [b.url for b in settings.backends] == [f"http://{host}:30000", f"http://{host}:30001"]
    headless = one(docs, "Service", "sr-specrouter-engine")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True


def test_dra_mode_runs_launch_pair_on_one_claim(tmp_path: Path) -> None:
    docs = render(VARIANTS["dra-three-gpus-external-redis"])
    sts = one(docs, "StatefulSet", "sr-specrouter-engine")
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 3
    (pair,) = pod["containers"]  # launch-pair, as in launchPair mode: one unit
    assert "initContainers" not in pod
    assert pair["command"] == ["specrouter", "launch-pair"]
    assert pair["resources"]["claims"] == [{"name": "gpu"}]
    assert "nvidia.com/gpu" not in json.dumps(pair["resources"])  # the claim gives the GPU
    claim = one(docs, "ResourceClaimTemplate", "sr-specrouter-engine-gpu")
    assert claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
    settings = router_settings(docs, tmp_path)
    assert settings.group_names() == ["gpu0", "gpu1", "gpu2"]
    assert len(settings.backends) == 6
    router = one(docs, "Deployment", "sr-specrouter-router")
    env = {e["name"]: e for e in router["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECROUTER_REDIS_URL"]["value"] == "redis://redis.infra:6379/2"
    assert not by_kind(docs, "HorizontalPodAutoscaler") and not by_kind(docs, "Secret")
    assert router["spec"]["replicas"] == 3
    assert len(by_kind(docs, "ServiceMonitor")) == 2


def test_router_only_uses_the_given_backends(tmp_path: Path) -> None:
    docs = render(VARIANTS["router-only-external-engines"])
    assert not by_kind(docs, "StatefulSet")
    assert [b.name for b in router_settings(docs, tmp_path).backends] == ["e0", "b0"]


def test_helm_lint_strict_has_no_warnings() -> None:
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 1 = info ("icon")
