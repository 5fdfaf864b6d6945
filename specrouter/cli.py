"""The `specrouter` command line.

Each subcommand lives in its own module, which exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them up, so adding a command never touches
another command's code. Modules are imported only when their command runs, so
`specrouter sim` never pays for the router's imports and the other way round.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("commands.serve", "run the router (OpenAI-compatible endpoint)"),
    "sim": ("sim.cli", "run simulated SGLang servers for one GPU group"),
    "demo": ("commands.demo", "run one simulated GPU group and the router on 127.0.0.1:8000"),
    "calibrate": ("commands.calibrate", "sweep one group's servers and derive policy thresholds"),
    "plan": ("commands.plan", "plan --mem-fraction-static for an EAGLE-3 + baseline pair"),
    "launch-pair": ("commands.launch_pair", "start an EAGLE-3 + baseline SGLang pair on one GPU"),
}


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"specrouter.{COMMANDS[name][0]}")


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrouter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _load(name).add_arguments(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(args_list)
    result: int = _load(args.command).run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
