"""A backend that misbehaves on purpose: the instrument for what a broken or hostile
upstream can make the router do.

Not a stand-in for SGLang (the simulator is that): a threaded loopback HTTP/1.1 server
that answers GET requests (health checks) with a small JSON 200 and every other request
with `answer(request, out)`, a script that writes raw bytes. A script that writes forever
ends when the router closes the connection, which sets `cut` (the router let go of it).
"""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import BinaryIO

from tests.drills.wiretap import serve_in_thread

HEALTHY = b'{"status":"ok"}'
CHUNK = b"a" * 65536


@dataclass
class Received:
    head: bytes
    body_bytes: int


Script = Callable[[Received, BinaryIO], None]


def endless(head: bytes, frame: Callable[[bytes], bytes] = lambda b: b,
            cap: int | None = None) -> Script:
    """A response head, then body bytes (each passed through `frame`) until the router
    closes the connection; with `cap`, at most that many, then silence for 30 s (a
    measurement of an unbounded router must not exhaust the machine)."""
    def script(_: Received, out: BinaryIO) -> None:
        out.write(head)
        sent = 0
        while cap is None or sent < cap:
            out.write(frame(CHUNK))
            out.flush()
            sent += len(CHUNK)
        threading.Event().wait(30.0)
    return script


def fixed(raw: bytes) -> Script:
    def script(_: Received, out: BinaryIO) -> None:
        out.write(raw)
    return script


@dataclass
class HostileBackend:
    answer: Script
    received: list[Received] = field(default_factory=list)
    arrived: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    gate: threading.Event = field(default_factory=threading.Event)  # scripts may wait on it
    cut: threading.Event = field(default_factory=threading.Event)
    server: socketserver.ThreadingTCPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def backends(self) -> list[dict[str, str]]:
        """Both pools of one group on this server (a retry lands here too)."""
        return [{"name": "e", "url": self.url, "pool": "eagle", "group": "g"},
                {"name": "b", "url": self.url.replace("127.0.0.1", "localhost"),
                 "pool": "baseline", "group": "g"}]

    def _serve(self, rfile: BinaryIO, wfile: BinaryIO) -> bool:
        """One request; False once the connection is done."""
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = rfile.readline(65536)
            if not line:
                return False
            head += line
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        left = length
        while left:  # read and drop: the test process holds no copy of the body
            left -= len(rfile.read(min(left, 1 << 20)) or b"x" * left)
        if head.startswith(b"GET "):
            wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n" % len(HEALTHY) + HEALTHY)
            wfile.flush()
            return True
        request = Received(head, length)
        self.received.append(request)
        self.arrived.release()
        self.answer(request, wfile)
        wfile.flush()
        return True

    def __enter__(self) -> HostileBackend:
        backend = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    while backend._serve(self.rfile, self.wfile):
                        pass
                except (TimeoutError, BrokenPipeError, ConnectionResetError):
                    backend.cut.set()

        self.server = serve_in_thread(Handler)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.server is not None
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
