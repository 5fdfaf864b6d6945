"""A stand-in for `sglang.launch_server` in launch-pair tests: real HTTP, an event journal.

It takes SGLang's flags (those launch-pair appends; it reads `--port` and
`--mem-fraction-static`, keeps the rest in `argv-<role>.json` next to the journal). It
answers `/ready` 503 until `--gate` exists (so a test controls when "loading" ends), then
200; `/health` likewise. Every lifecycle event (start, ready, signal) is appended to
`--journal` with the role and pid, which is how the tests see start order and signals.
With `--fork-child` it forks a child in its process group, as SGLang forks its scheduler
and detokenizer; `--child-ignores-term` makes that child ignore SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--gate", type=Path)
    parser.add_argument("--mem-fraction-static", default="")
    parser.add_argument("--fork-child", action="store_true")
    parser.add_argument("--child-ignores-term", action="store_true")
    args, _sglang_rest = parser.parse_known_args()
    (args.journal.parent / f"argv-{args.role}.json").write_text(json.dumps(sys.argv[1:]))

    def note(event: str, pid: int | None = None) -> None:
        with args.journal.open("a") as fh:
            fh.write(f"{event} {args.role} {pid or os.getpid()} {args.mem_fraction_static}\n")

    if args.fork_child:
        child = os.fork()
        if child == 0:  # the "scheduler": same process group, outlives a SIGKILLed leader
            if args.child_ignores_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(3600)
        note("child", child)

    ready_noted = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ready = args.gate is None or args.gate.exists()
            if ready and not ready_noted.is_set():
                ready_noted.set()
                note("ready")
            if not ready:
                note("probe-while-loading")
            self.send_response(200 if ready else 503)
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)

    def on_signal(signum: int, _frame: object) -> None:
        note(f"signal-{signal.Signals(signum).name}")
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    note("start")
    server.serve_forever()
    note("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
