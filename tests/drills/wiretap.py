"""A recording HTTP endpoint: the instrument that shows what bytes reached an upstream.

Not a stand-in for SGLang (the simulator is that): it answers every request with a tiny
JSON 200 and keeps the raw request bytes, so a test can check that the router forwarded a
body byte for byte, and that a request never made the router connect somewhere else.
"""

from __future__ import annotations

import socketserver
import threading
from dataclasses import dataclass, field
from types import TracebackType

BODY = b'{"object":"wiretap","ok":true}'


def serve_in_thread(
    handler: type[socketserver.BaseRequestHandler],
) -> socketserver.ThreadingTCPServer:
    """A threaded TCP server on a free loopback port, serving in a daemon thread."""
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Recorded:
    head: bytes
    body: bytes

    @property
    def path(self) -> str:
        return self.head.split(b" ", 2)[1].decode("latin-1")


@dataclass
class Wiretap:
    requests: list[Recorded] = field(default_factory=list)
    server: socketserver.ThreadingTCPServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        port: int = self.server.server_address[1]
        return port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generation_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.head.startswith(b"POST ")]

    def __enter__(self) -> Wiretap:
        tap = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while True:
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = self.rfile.readline(65536)
                        if not line:
                            return
                        head += line
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value.strip())
                    body = self.rfile.read(length) if length else b""
                    tap.requests.append(Recorded(head, body))
                    self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
                    self.wfile.flush()

        self.server = serve_in_thread(Handler)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
