"""The compose stack's engines: one service per GPU running launch-pair, resolved with the
example .env, valid under the Compose Specification, and its flags accepted by launch-pair's
own parser with a plan that fits."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

import yaml

from specrouter.commands import launch_pair
from specrouter.commands.memplan import plan_pair
from specrouter.commands.plan import plan_input_from_args, server_args
from specrouter.config import load_settings
from tests.deploy.test_compose import (
    COMPOSE_DIR,
    compose_with_env,
    env_example,
    interpolate,
    raw_compose,
    validate,
)


def launch_args(env: dict[str, str] | None = None) -> argparse.Namespace:
    """The engines service's command, interpolated value by value after parsing (as compose
    does), then parsed by launch-pair's own argument parser."""
    values = {**env_example(), **(env or {})}
    command = [interpolate(item, values) for item in raw_compose()["services"]["engines-gpu0"]
               ["command"]]
    parser = argparse.ArgumentParser()
    launch_pair.add_arguments(parser)
    return parser.parse_args(command)


def engines(services: dict[str, Any]) -> dict[str, Any]:
    return {name: s for name, s in services.items() if name.startswith("engines-")}


def test_one_engines_service_per_gpu_runs_the_pair() -> None:
    validate(raw_compose())
    services = compose_with_env()["services"]
    assert set(engines(services)) == {"engines-gpu0"}
    assert not {"eagle", "baseline"} & set(services)  # no server runs in a container alone
    pair = services["engines-gpu0"]
    assert pair["build"]["dockerfile"] == "deploy/docker/engine.Dockerfile"
    assert ":latest" not in pair["build"]["args"]["SGLANG_IMAGE"]
    (device,) = pair["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["0"] and device["capabilities"] == ["gpu"]
    assert pair["restart"] == "unless-stopped"
    health = " ".join(pair["healthcheck"]["test"])
    assert "/health" in health and "30000" in health and "30001" in health
    assert services["router"]["depends_on"]["engines-gpu0"]["condition"] == "service_started"


def test_the_command_is_launch_pairs_and_the_plan_fits() -> None:
    args = launch_args()
    plan = plan_pair(plan_input_from_args(args))
    eagle, baseline = plan.servers
    assert (eagle.role, eagle.max_total_tokens) == ("eagle", 200_000)
    assert baseline.max_total_tokens > 400_000 and plan.unused_gib >= 0
    argv = server_args(plan, "baseline", args)
    assert argv[argv.index("--max-total-tokens") + 1] == str(baseline.max_total_tokens)
    assert args.stop_timeout < 60  # inside compose's stop_grace_period


def test_extra_args_from_env_reach_sglang_split_not_templated() -> None:
    args = launch_args({"BASELINE_EXTRA_ARGS": """--json-model-override-args '{"a": {"b": 1}}'"""})
    plan = plan_pair(plan_input_from_args(args))
    assert server_args(plan, "baseline", args)[-2:] == [
        "--json-model-override-args", '{"a": {"b": 1}}']
    assert "--json-model-override-args" not in server_args(plan, "eagle", args)
    assert shlex.split(args.baseline_extra_args)  # a plain string launch-pair splits itself


def test_router_and_prometheus_reach_both_servers_of_the_pair() -> None:
    args = launch_args()
    settings = load_settings(COMPOSE_DIR / "specrouter.yaml", environ={})
    urls = {b.pool: b.url for b in settings.backends}
    assert urls == {"eagle": f"http://engines-gpu0:{args.eagle_port}",
                    "baseline": f"http://engines-gpu0:{args.baseline_port}"}
    assert {b.group for b in settings.backends} == {"gpu0"}
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert {f"engines-gpu0:{args.eagle_port}", f"engines-gpu0:{args.baseline_port}"} <= targets
