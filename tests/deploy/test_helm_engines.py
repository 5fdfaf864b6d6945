"""The chart's engine pods, rendered by Helm's own engine and validated (the machinery of
test_helm.py): launch-pair in both GPU modes with arguments its own parser accepts, extraArgs
passed verbatim, the model cache volume, and the values the chart refuses."""

from __future__ import annotations

import argparse
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from specrouter.commands import launch_pair
from specrouter.commands.memplan import plan_pair
from specrouter.commands.plan import plan_input_from_args, server_args
from tests.deploy.test_helm import CHART, KUBE_VERSION, one, render

STS = "sr-specrouter-engine"


def pod_of(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = render(values)
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    sts = one(docs, "StatefulSet", STS)
    return sts, sts["spec"]["template"]["spec"]


def parsed(container: dict[str, Any]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch_pair.add_arguments(parser)
    return parser.parse_args(container["args"])


@pytest.mark.parametrize("mode", ["launchPair", "dra"])
def test_both_gpu_modes_run_launch_pair_with_a_plan_that_fits(mode: str) -> None:
    _sts, pod = pod_of({"engines": {"gpuSharing": mode}})
    (pair,) = pod["containers"]
    assert "initContainers" not in pod
    assert pair["command"] == ["specrouter", "launch-pair"]
    args = parsed(pair)
    plan = plan_pair(plan_input_from_args(args))
    assert plan.by_role("eagle").max_total_tokens == 200_000 and plan.unused_gib >= 0
    assert args.sglang_version == "0.5.23"
    assert pod["terminationGracePeriodSeconds"] > args.stop_timeout
    ports = {p["name"]: p["containerPort"] for p in pair["ports"]}
    assert ports == {"eagle": args.eagle_port, "baseline": args.baseline_port}


def test_extra_args_with_braces_and_quotes_reach_sglang_verbatim() -> None:
    override = '{"rope_scaling": {"type": "yarn", "factor": 4.0}, "name": "it\'s"}'
    _sts, pod = pod_of({"engines": {
        "eagle": {"extraArgs": ["--json-model-override-args", override]},
        "baseline": {"extraArgs": ["--enable-cache-report"]},
    }})
    args = parsed(pod["containers"][0])
    plan = plan_pair(plan_input_from_args(args))
    assert server_args(plan, "eagle", args)[-2:] == ["--json-model-override-args", override]
    assert server_args(plan, "baseline", args)[-1] == "--enable-cache-report"


def test_model_cache_is_an_emptydir_a_pvc_per_pod_or_an_existing_claim() -> None:
    sts, pod = pod_of({})
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["model-cache"]
    assert "volumeClaimTemplates" not in sts["spec"]

    sts, pod = pod_of({"engines": {"modelCache": {"persistentVolumeClaim": {
        "enabled": True, "size": "200Gi", "storageClassName": "fast"}}}})
    (template,) = sts["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "model-cache"
    assert template["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert template["spec"]["storageClassName"] == "fast"
    assert "model-cache" not in {v["name"] for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["model-cache"] == "/root/.cache/huggingface"

    sts, pod = pod_of({"engines": {"modelCache": {"existingClaim": "hf-models"}}})
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "hf-models"}
    assert "volumeClaimTemplates" not in sts["spec"]


@pytest.mark.parametrize("bad", [
    {"engines": {"enabled": False}},  # the router would have no backend and crash-loop
    {"engines": {"enabled": False}, "router": {"extraBackends": []}},
    {"engines": {"sglangVersion": "latest"}},
    {"engines": {"modelCache": {"persistentVolumeClaim": {"size": "lots"}}}},
    {"engines": {"eagle": {"memFractionStatic": 0.3}}},  # planned, not set by hand
])
def test_schema_refuses_engine_values(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        helm.Chart.load(str(CHART)).validate_schema(bad)


def test_equal_ports_are_refused_at_render() -> None:
    # JSON Schema (draft 7) cannot compare two fields: the template refuses them
    with pytest.raises(helm.HelmRenderError, match="both 30000"):
        render({"engines": {"baseline": {"port": 30000}}})
