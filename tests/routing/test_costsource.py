"""Cost models from configuration: the three sources, their start-up errors, and the
assembled router seeing them (GET /policy's live view)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specrouter.assembly import build_product
from specrouter.config import ConfigError, Settings, load_settings
from specrouter.routing.costmodel import (
    SweepPoint,
    fit_group_model,
    model_from_dict,
    model_to_dict,
)
from specrouter.routing.costsource import SHIPPED_PROFILES, profile_model
from specrouter.routing.loadaware import LoadAwareRouter
from tests.fixtures.procs import CALIBRATION_DIR

CALIB_TABLE = str(Path(CALIBRATION_DIR) / "llama3-8b-ctx2048.jsonl")
BACKENDS = [
    {"name": f"{g}-{p}", "url": f"http://127.0.0.1:{port}", "pool": p, "group": g}
    for g, base in (("gpu0", 30000), ("gpu1", 30010))
    for p, port in (("eagle", base), ("baseline", base + 1))
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("SPECROUTER_"):
            monkeypatch.delenv(key)


def _env(**extra: str) -> dict[str, str]:
    return {"SPECROUTER_BACKENDS": json.dumps(BACKENDS), **extra}


def _settings_from_env(monkeypatch: pytest.MonkeyPatch, **extra: str) -> Settings:
    for key, value in _env(**extra).items():
        monkeypatch.setenv(key, value)
    return load_settings()


def test_env_profile_by_name_gives_every_group_the_simulator_physics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = _settings_from_env(monkeypatch, SPECROUTER_COST_MODEL__PROFILE="h200-llama3-8b",
                           SPECROUTER_COST_MODEL__CTX="2048")
    models = s.group_cost_models()
    assert set(models) == {"gpu0", "gpu1"}
    m = models["gpu0"]
    # From the profile: accept 2.5, EAGLE capped at 48, baseline at 256 running requests.
    assert (m.nominal_accept_length, m.eagle_max_batch, m.baseline_max_batch) == (2.5, 48, 256)
    # docs/policy.md's crossover table (chain 3/1/4, SGLang's EAGLE cap of 48).
    assert m.crossover(1.6) == pytest.approx(12.4, abs=0.05)
    assert m.crossover(3.0) == pytest.approx(61.6, abs=0.05)


def test_profile_time_factor_scales_the_steps_not_the_choice(tmp_path: Path) -> None:
    raw = json.loads((SHIPPED_PROFILES / "h200-llama3-8b.json").read_text())
    raw["step_table"] = str(SHIPPED_PROFILES / raw["step_table"])
    raw["time_factor"] = 2.0
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(raw))
    base, doubled = profile_model("h200-llama3-8b", 2048), profile_model(str(slow), 2048)
    assert doubled.predict("baseline", 8, 1.0).step_ms == pytest.approx(
        2 * base.predict("baseline", 8, 1.0).step_ms)
    assert doubled.crossover(2.0) == pytest.approx(base.crossover(2.0))


def test_yaml_per_group_entry_wins_over_the_default(tmp_path: Path) -> None:
    model_file = tmp_path / "gpu1.json"
    fitted = fit_group_model([SweepPoint(1, 190.0), SweepPoint(8, 1400.0), SweepPoint(32, 4000.0)],
                             [SweepPoint(1, 420.0), SweepPoint(8, 2600.0), SweepPoint(32, 3500.0)],
                             2.6)
    model_file.write_text(json.dumps(model_to_dict(fitted)))
    config = tmp_path / "router.yaml"
    config.write_text(
        f"backends: {json.dumps(BACKENDS)}\n"
        "cost_model:\n"
        f"  step_table: {CALIB_TABLE}\n"
        "  draft: {steps: 5, topk: 4, num_draft_tokens: 8}\n"
        "  accept_length: 2.2\n"
        "cost_models:\n"
        f"  gpu1: {{file: {model_file}}}\n"
    )
    models = load_settings(config).group_cost_models()
    assert models["gpu1"] == fitted
    table = models["gpu0"]
    assert (table.nominal_accept_length, table.eagle_max_batch, table.baseline_max_batch) == (
        2.2, 48, None)
    # docs/policy.md: tree 5/4/8 crosses at 16.8 at accept 2.0 without the cap.
    assert table.crossover(2.0) == pytest.approx(16.8, abs=0.05)


def test_cost_model_file_round_trips_both_curve_kinds() -> None:
    poly = fit_group_model([SweepPoint(1, 100.0), SweepPoint(4, 350.0)],
                           [SweepPoint(1, 200.0), SweepPoint(4, 600.0)], 2.0,
                           eagle_max_batch=48)
    assert model_from_dict(json.loads(json.dumps(model_to_dict(poly)))) == poly
    table = profile_model("h200-llama3-8b", 8192)
    again = model_from_dict(json.loads(json.dumps(model_to_dict(table))))
    assert again.crossover(2.5) == pytest.approx(table.crossover(2.5))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"profile": "no-such-profile"},
         "cost_model: profile .*no-such-profile.json does not exist"),
        ({"step_table": "/nonexistent/t.jsonl"}, "step table /nonexistent/t.jsonl does not exist"),
        ({"step_table": "BAD"}, "step table line 1: not JSON"),
        ({"step_table": CALIB_TABLE, "draft": {"num_draft_tokens": 32}},
         "no verify column target_qN_ms with N >= 32"),
        ({"file": "BAD"}, "cost-model file .*: not JSON"),
        ({"file": "NOTMODEL"}, "not a cost-model file"),
        ({"profile": "seed-coding", "file": "x.json"},
         "exactly one of step_table, profile or file"),
        ({}, "exactly one of step_table, profile or file \\(got none\\)"),
        ({"profile": "seed-coding", "ctx": 1024, "steps": 3}, "cost_model.steps: Extra inputs"),
    ],
)
def test_bad_sources_stop_start_up_with_the_field_named(
    tmp_path: Path, section: dict[str, Any], message: str,
) -> None:
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    paths = {"BAD": str(tmp_path / ("bad.jsonl" if "step_table" in section else "bad.json")),
             "NOTMODEL": str(tmp_path / "other.json")}
    section = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in section.items()}
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides={"backends": BACKENDS, "cost_model": section})


def test_a_cost_model_for_an_unknown_group_is_refused() -> None:
    with pytest.raises(ConfigError, match="cost_models: no GPU group named gpu7"):
        load_settings(overrides={"backends": BACKENDS,
                                 "cost_models": {"gpu7": {"profile": "seed-coding",
                                                          "ctx": 1024}}})


def test_assembled_router_reports_the_configured_model_on_policy() -> None:
    settings = load_settings(overrides={
        "backends": BACKENDS, "telemetry": {"enabled": False},
        "policy": {"strategy": "goodput"},
        "cost_models": {"gpu0": {"profile": "h200-llama3-8b", "ctx": 2048}},
    })
    router = build_product(settings).router
    assert isinstance(router, LoadAwareRouter)
    groups = {g["group"]: g for g in router.live_view()["groups"]}
    # No telemetry reading yet: the predictions use the profile's nominal accept length.
    assert groups["gpu0"]["accept_length"] is None
    assert groups["gpu0"]["accept_length_used"] == groups["gpu0"]["nominal_accept_length"] == 2.5
    assert groups["gpu0"]["crossover"] == pytest.approx(44.4, abs=0.1)
    assert set(groups["gpu0"]["predictions"]) == {"eagle", "baseline"}
    # the configured model seeds gpu0's online model; gpu1 learns from the prior alone
    assert groups["gpu0"]["learned"]["seeded"] is True
    assert groups["gpu1"]["learned"]["seeded"] is False
    assert groups["gpu1"]["learned"]["pools"]["eagle"]["prior_share"] == 1.0
    assert groups["gpu1"]["reason"].startswith("goodput_")


def test_metrics_show_the_learned_model_and_sustained_load() -> None:
    settings = load_settings(overrides={
        "backends": BACKENDS, "telemetry": {"enabled": False},
        "cost_models": {"gpu0": {"profile": "h200-llama3-8b", "ctx": 2048}},
    })
    product = build_product(settings)
    text = product.metrics.render().decode()
    assert 'specrouter_group_sustained_load{group="gpu0"} 0.0' in text
    assert 'specrouter_learned_crossover{group="gpu0"} 44.' in text
    assert 'specrouter_learned_prior_share{group="gpu1",pool="eagle"} 1.0' in text
    assert 'specrouter_learned_step_ms{batch="8",group="gpu0",pool="baseline"}' in text
