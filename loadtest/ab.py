"""Router variants side by side on one host: CPU per request and TTFT, interleaved.

    python -m loadtest.ab [--connections 100] [--chunks 2] [--span-ms 150] [--rounds 2]
                          [--seconds 6] [--think-s 0.02] [--json FILE] VARIANT [VARIANT ...]

A VARIANT is `NAME=SPEC`, SPEC a JSON object (empty for the defaults) with any of:
`env` (environment variables of that router, e.g. `{"SPECROUTER_AFFINITY__ENABLED":
"false"}`), `python` (the interpreter that runs it: another venv with the project
installed), `tree` (a checkout whose `specrouter` package it runs: another commit's
worktree). `floor-asgi`, `floor-protocol`, `floor-routed` and `floor-task` name the
reference relays of `loadtest.floor_proxy` instead, and `sglang-router` the SGLang model
gateway (the `peer` scenario's; `pip install '.[bench]'`): no SPEC.

Every variant is one process in front of one instant upstream (`loadtest.instant_upstream`,
one backend declared EAGLE-3, as in the `peer` scenario) streaming `--chunks` chunks over
`--span-ms`; each is warmed, then the variants take turns for `--rounds` phases of
`--seconds` of closed-loop streams, so host drift spreads over all of them. A variant's
figures: requests/s, its process's user and system CPU per request, TTFT p50/p99 of the
requests started after each phase's first 0.5 s. What two variants differ by must be
larger than the spread of their rounds (printed) before it is a difference.

A `tree` variant needs care: `python -m specrouter` puts the working directory (this
checkout) first on `sys.path`, ahead of `PYTHONPATH`. So the variant runs with
`loadtest/abtree` on `PYTHONPATH`, whose `sitecustomize` imports the package from the
tree before `-m` resolves it: every submodule then comes from the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.instant_upstream import MODEL as INSTANT_MODEL
from loadtest.metrics import write_json
from loadtest.procs import Stack
from loadtest.promptset import RequestShape
from loadtest.scenarios import overhead
from loadtest.scenarios.peer import FLOORS, PEER_KEY, floor_starter, start_sglang_router

#: The relays of `loadtest.floor_proxy` a variant may name: the `peer` scenario's floors
#: and the ASGI floor's exchange without uvicorn.
RELAYS = {**{name: kind for name, (kind, _) in FLOORS.items()}, "floor-task": "task"}
#: The directory whose `sitecustomize` imports `specrouter` from `SPECROUTER_AB_TREE`.
TREE_SITE = Path(__file__).resolve().parent / "abtree"
TREE_VARIABLE = "SPECROUTER_AB_TREE"


@dataclass
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    tree: str | None = None

    def process_env(self) -> dict[str, str]:
        """The router's environment: `env`, and for a `tree` the site that imports it."""
        env = dict(self.env)
        if self.tree is not None:
            paths = [str(TREE_SITE), *filter(None, [env.get("PYTHONPATH")])]
            env.update({"PYTHONPATH": os.pathsep.join(paths), TREE_VARIABLE: self.tree})
        return env


def parse_variant(text: str) -> Variant:
    """`NAME=SPEC` (module docstring); a clear error for anything else."""
    name, sep, spec = text.partition("=")
    if not name or (not sep and name not in RELAYS and name != PEER_KEY):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SPEC (SPEC may be empty)")
    fields: dict[str, Any] = json.loads(spec) if spec.strip() else {}
    unknown = set(fields) - {"env", "python", "tree"}
    if not isinstance(fields, dict) or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: SPEC takes env, python and tree only")
    tree = fields.get("tree")
    return Variant(name, {k: str(v) for k, v in fields.get("env", {}).items()},
                   fields.get("python", sys.executable),
                   str(Path(tree).resolve()) if tree else None)


def _start(stack: Stack, variant: Variant, upstream_url: str) -> tuple[str, int]:
    if variant.name in RELAYS:
        return floor_starter(RELAYS[variant.name])(stack, upstream_url)
    if variant.name == PEER_KEY:
        return start_sglang_router(stack, upstream_url)
    router = stack.router(overhead.one_backend(upstream_url), env=variant.process_env(),
                          python=variant.python)
    return router.url, router.child.pid


def compare(variants: list[Variant], args: argparse.Namespace) -> dict[str, Any]:
    """Each variant's figures over all its rounds (`overhead`'s warmed rotation), CPU in
    microseconds."""
    s = overhead.OverheadSettings(seed=args.seed, rounds=args.rounds)
    gap = args.span_ms / (args.chunks - 1) if args.chunks > 1 else 0.0
    shape = RequestShape(INSTANT_MODEL, s.input_tokens, args.chunks)
    with Stack() as stack:
        upstream = stack.instant_upstream(chunks=args.chunks, gap_ms=gap)
        paths = {v.name: _start(stack, v, upstream.url) for v in variants}
        figures = overhead._warmed_rotation(s, paths, shape, args.connections, args.seconds,
                                            args.think_s)
    return {"settings": vars(args) | {"variants": [v.__dict__ for v in variants]},
            "variants": {name: _in_us(f) for name, f in figures.items()}}


def _in_us(f: dict[str, Any]) -> dict[str, Any]:
    """A path's figures with its CPU per request in microseconds."""
    return {"requests": f["requests"], "req_s": f["req_s"],
            "user_us": f["user_ms_per_request"] * 1e3, "sys_us": f["sys_ms_per_request"] * 1e3,
            "cpu_us": f["cpu_ms_per_request"] * 1e3,
            "cpu_us_by_round": [ms * 1e3 for ms in f["cpu_ms_by_round"]],
            "ttft_p50_ms": f["ttft_p50_ms"], "ttft_p99_ms": f["ttft_p99_ms"]}


def lines(result: dict[str, Any]) -> list[str]:
    out = ["| variant | req/s | CPU us/request (user + sys) | rounds | TTFT p50 / p99 ms |",
           "|---|---|---|---|---|"]
    for name, f in result["variants"].items():
        rounds = " / ".join(f"{x:.0f}" for x in f["cpu_us_by_round"])
        out.append(f"| {name} | {f['req_s']:.1f} | {f['cpu_us']:.1f} ({f['user_us']:.1f} + "
                   f"{f['sys_us']:.1f}) | {rounds} | {f['ttft_p50_ms']:.2f} / "
                   f"{f['ttft_p99_ms']:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", type=parse_variant, metavar="VARIANT")
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--span-ms", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--think-s", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=overhead.OverheadSettings.seed)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    names = [v.name for v in args.variants]
    if len(set(names)) != len(names):
        parser.error("variant names must differ")
    variants = args.variants
    del args.variants
    result = compare(variants, args)
    print("\n".join(lines(result)))
    if args.json:
        write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
