"""`specrouter calibrate`: measure where the baseline overtakes EAGLE-3 on one GPU group.

A closed-loop concurrency sweep of each pool, directly against its server and one pool at
a time (`client`). At each level C, C workers send streaming chat requests back to back
(fixed prompt and output length, `ignore_eos`, every prompt its own so that no prefill is
served from cache), and the level reports output throughput (the tokens decoded before the
level's deadline, while C requests were in flight) and latency (`measure`). From the two
curves follow the crossover and the policy (`derive`), for a strategy that predicts with a
cost model the group's model (`fit`), and the printed report (`report`).

The default strategy is the router's own (`online`): the calibration is then a seed of the
model the router learns from telemetry, not a setting it depends on. `--write-cost-model
FILE` writes that seed for the router's `cost_model.file`; `--apply` PATCHes the policy
into a running router's `/policy`; `--write-policy FILE` writes it for `specrouter serve
--policy-file FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict
from typing import Any

import httpx

from specrouter.commands.calibrate.client import LoadShape, apply_policy, sweep
from specrouter.commands.calibrate.derive import Recommendation, recommend
from specrouter.commands.calibrate.fit import FITS, fit_model
from specrouter.commands.calibrate.measure import LevelResult, SweepFacts
from specrouter.commands.calibrate.report import level_row, model_report, report
from specrouter.routing.costmodel import GroupCostModel, model_to_dict
from specrouter.routing.strategies.registry import DEFAULT_STRATEGY, STRATEGIES

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("concurrency levels: comma-separated integers") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return tuple(sorted(set(levels)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eagle-url", required=True, help="the group's EAGLE-3 server")
    parser.add_argument("--baseline-url", required=True, help="the group's baseline server")
    parser.add_argument("--api-key", help="the servers' API key (also: SPECROUTER_API_KEY)")
    parser.add_argument("--model", help="model name to send (default: the server's)")
    parser.add_argument("--concurrency", type=_levels, default=DEFAULT_LEVELS,
                        help="comma-separated levels (default 1,2,4,8,16,32,64)")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=float, help="seconds per level (default 20)")
    amount.add_argument("--requests", type=int, help="requests per level instead of a duration")
    parser.add_argument("--input-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default=DEFAULT_STRATEGY,
                        help="policy to derive (default: the router's, %(default)s); a "
                             "strategy that predicts with a cost model (online, goodput) "
                             "also gets the group's model fitted: serve it with "
                             "--write-cost-model")
    parser.add_argument("--write-cost-model", metavar="FILE",
                        help="write the cost model fitted from the sweep (for the router's "
                             "cost_model.file / SPECROUTER_COST_MODEL__FILE)")
    parser.add_argument("--fit", choices=FITS, default="table",
                        help="cost model curves: table (through the measured levels, "
                             "default), linear (a + b*B) or quadratic (+ c*B^2)")
    parser.add_argument("--router-url", help="router whose /policy --apply changes")
    parser.add_argument("--admin-token", help="the router's admin token "
                                              "(also: SPECROUTER_ADMIN_TOKEN)")
    parser.add_argument("--apply", action="store_true", help="PATCH the policy into the router")
    parser.add_argument("--write-policy", metavar="FILE",
                        help="write the policy as JSON (for serve --policy-file)")
    parser.add_argument("--json", metavar="FILE", help="write all measurements as JSON")


def run(args: argparse.Namespace) -> int:
    token: str | None = args.admin_token or os.environ.get("SPECROUTER_ADMIN_TOKEN")
    if args.apply and not (args.router_url and token):
        return _fail("--apply needs --router-url and an admin token", 2)
    if args.requests is not None and args.requests < 1:
        return _fail("--requests must be >= 1", 2)
    duration = None if args.requests is not None else (args.duration or 20.0)
    shape = LoadShape(args.input_tokens, args.output_tokens, args.model)
    api_key = args.api_key or os.environ.get("SPECROUTER_API_KEY")
    urls = {"eagle": args.eagle_url, "baseline": args.baseline_url}
    try:
        results, facts = asyncio.run(sweep(urls, args.concurrency, shape, api_key, duration,
                                           args.requests, on_level=_print_level))
    except KeyboardInterrupt:
        return 130
    if any(r.requests == 0 for rs in results.values() for r in rs):
        return _fail("a level completed no request; check the servers", 1)
    rec = recommend(results, args.strategy)
    print(report(results, rec, facts.accept_length))
    model: GroupCostModel | None = None
    if STRATEGIES[args.strategy].uses_cost_model or args.write_cost_model:
        try:
            model = fit_model(results, facts, args.fit)
        except ValueError as exc:
            return _fail(f"cannot fit the cost model: {exc}", 1)
        print(model_report(model))
    _write_outputs(args, shape, results, facts, rec, model)
    if args.apply and token:
        return _apply(args, token, rec)
    return 0


def _write_outputs(args: argparse.Namespace, shape: LoadShape,
                   results: dict[str, list[LevelResult]], facts: SweepFacts,
                   rec: Recommendation, model: GroupCostModel | None) -> None:
    if args.json:
        _write_json(args.json, {"levels": {p: [r.summary() for r in rs]
                                           for p, rs in results.items()},
                                "accept_length": facts.accept_length,
                                "accept_length_by_level": facts.accept_by_level,
                                "max_running_requests": facts.max_running,
                                "crossover": rec.crossover, "policy": rec.patch,
                                "cost_model": None if model is None else model_to_dict(model),
                                "shape": asdict(shape)})
    if model is not None and args.write_cost_model:
        _write_json(args.write_cost_model, {**model_to_dict(model), "calibration": {
            "shape": asdict(shape), "levels": list(args.concurrency), "fit": args.fit,
            "crossover_measured": rec.crossover,
            "crossover_model": model.crossover(model.nominal_accept_length)}})
        print(f"cost model written to {args.write_cost_model} "
              f"(serve with SPECROUTER_COST_MODEL__FILE={args.write_cost_model})")
    if args.write_policy:
        _write_json(args.write_policy, rec.patch)
        print(f"policy written to {args.write_policy}")


def _apply(args: argparse.Namespace, token: str, rec: Recommendation) -> int:
    try:
        applied = asyncio.run(apply_policy(args.router_url, token, rec.patch))
    except (RuntimeError, httpx.HTTPError) as exc:
        return _fail(f"could not apply the policy: {exc}", 1)
    print(f"applied to {args.router_url}: policy version {applied['policy']['version']}")
    if STRATEGIES[args.strategy].uses_cost_model:
        print("note: the router predicts with the cost models of its own configuration "
              "(cost_model / cost_models); a group without one uses the threshold band")
    return 0


def _print_level(result: LevelResult) -> None:
    print(level_row(result), flush=True)


def _fail(message: str, code: int) -> int:
    print(f"specrouter calibrate: {message}", file=sys.stderr)
    return code


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
