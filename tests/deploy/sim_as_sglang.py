"""Runs the simulator where launch-pair starts `sglang.launch_server`: takes SGLang's flags,
reads `--port`, and replaces itself with `specrouter sim --single <role>` on that port."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", required=True)
    parser.add_argument("--port", required=True)
    args, _sglang_rest = parser.parse_known_args()
    os.execv(sys.executable, [sys.executable, "-m", "specrouter", "sim", "--single", args.role,
                              "--port", args.port, "--time-scale", "0.05"])


if __name__ == "__main__":
    main()
