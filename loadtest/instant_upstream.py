"""An upstream that answers at once: what a router's own request rate is measured against.

    python -m loadtest.instant_upstream --port 8000

Every POST to /v1/chat/completions is answered with one whole streamed completion of one
token (an OpenAI chunk, a finish chunk, `data: [DONE]`, chunked), written in one piece
as soon as the request's last byte is read; GET /v1/models lists the model `instant`;
GET /health answers 200; everything else 404 (so a router reads no telemetry from it
and counts its own in-flight requests). One process on uvloop with httptools: a few tens
of microseconds of CPU per request, so that with the load generator and a router on the
same host the router is what runs out of CPU first (the simulator's own HTTP server and
step loop cost more per request than a router, and its throughput moves with the number
of connections: docs/router.md section 6).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools
import uvloop

MODEL = "instant"
_CHUNK = {"id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0,
          "model": MODEL}


def _event(payload: object) -> bytes:
    data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    return b"%x\r\n%b\n\n\r\n" % (len(data) + 2, data)


STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
    + _event({**_CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"},
                                     "finish_reason": None}]})
    + _event({**_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17}})
    + _event(b"[DONE]") + b"0\r\n\r\n")


def _json(body: object) -> bytes:
    data = json.dumps(body).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(data), data))


ANSWERS = {
    (b"POST", b"/v1/chat/completions"): STREAM,
    (b"GET", b"/v1/models"): _json({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "loadtest"}]}),
    (b"GET", b"/health"): b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class InstantProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCP transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        assert self.transport is not None
        method = self.parser.get_method()
        path = self.url.partition(b"?")[0]
        self.transport.write(ANSWERS.get((method, path), NOT_FOUND))
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(InstantProtocol, host, port, backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
