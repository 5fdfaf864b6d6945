"""An upstream that answers at once: what a router's own costs are measured against.

    python -m loadtest.instant_upstream --port 8000 [--chunks 16 --gap-ms 10]

Every POST to /v1/chat/completions is answered with a streamed completion of `--chunks`
tokens, one OpenAI chunk each, then a finish chunk and `data: [DONE]` (chunked): with one
chunk and no gap the whole answer is written in one piece as soon as the request's last
byte is read; otherwise the head and the first chunk are, and each further chunk follows
`--gap-ms` later (a near-free engine streaming at a fixed pace). The request's body is not
read, and a connection serves one request at a time (no pipelining). GET /v1/models
lists the model `instant`; GET /health answers 200; GET /v1/loads answers as SGLang
0.5.23 does with nothing running (so a router's telemetry poll costs one request, as
against SGLang); GET /metrics answers what the simulator renders for an idle EAGLE-3
engine of SGLang 0.5.23 after one request, as a server started with --enable-metrics
(`specrouter plan`'s command lines) does, so that the router's side reads of the accept
length parse an exposition of SGLang's size and shape; everything else 404. One process on uvloop
with httptools, 13-18 us of CPU a request (the bench's direct rows), so that with the load
generator and a router on the same host the router is what runs out of CPU first (the
simulator's own HTTP server and step loop cost more per request than a router, and its
throughput moves with the number of connections: docs/router.md section 6).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools
import uvloop

from specrouter.sim.engine import Engine
from specrouter.sim.gpu import SharedGpu, SimClock
from specrouter.sim.metrics import EngineMetrics
from specrouter.sim.profile import engine_limits, load_profile
from specrouter.sim.version import V0_5_23

MODEL = "instant"
_CHUNK = {"id": "chatcmpl-instant", "object": "chat.completion.chunk", "created": 0,
          "model": MODEL}


def _event(payload: object) -> bytes:
    data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    return b"%x\r\n%b\n\n\r\n" % (len(data) + 2, data)


HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
FIRST = _event({**_CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                              "content": "a"},
                                       "finish_reason": None}]})
TOKEN = _event({**_CHUNK, "choices": [{"index": 0, "delta": {"content": "a"},
                                       "finish_reason": None}]})


def _end(tokens: int) -> bytes:
    return (_event({**_CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 16, "completion_tokens": tokens,
                              "total_tokens": 16 + tokens}})
            + _event(b"[DONE]") + b"0\r\n\r\n")


def _json(body: object) -> bytes:
    data = json.dumps(body).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(data), data))


COMPLETIONS = (b"POST", b"/v1/chat/completions")
ANSWERS = {
    (b"GET", b"/v1/models"): _json({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "loadtest"}]}),
    (b"GET", b"/health"): b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    # SGLang 0.5.23's load endpoint, nothing running: a router polls it as it polls SGLang
    (b"GET", b"/v1/loads"): _json({
        "timestamp": "2026-12-06T00:00:00+00:00", "version": "0.5.23", "accelerator": "none",
        "num_accelerators": 1, "loads": [{"dp_rank": 0, "timestamp": 1796515200.0,
                                          "num_running_reqs": 0, "num_waiting_reqs": 0}]}),
}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class InstantProtocol(asyncio.Protocol):
    def __init__(self, chunks: int, gap_s: float) -> None:
        self.chunks, self.gap_s = chunks, gap_s
        self.whole = HEAD + FIRST + TOKEN * (chunks - 1) + _end(chunks) if gap_s <= 0 else b""
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
        asked = (self.parser.get_method(), self.url.partition(b"?")[0])
        if asked != COMPLETIONS:
            self._last(ANSWERS.get(asked, NOT_FOUND))
        elif self.whole:
            self._last(self.whole)
        else:
            self.transport.write(HEAD + FIRST)
            self._next(1, self.parser.should_keep_alive())

    def _next(self, sent: int, keep_alive: bool) -> None:
        """The chunk after `sent` ones, `gap_s` from now (the end after the last)."""
        loop = asyncio.get_running_loop()
        if sent < self.chunks:
            loop.call_later(self.gap_s, self._chunk, sent, keep_alive)
        else:
            loop.call_later(self.gap_s, self._finish, keep_alive)

    def _chunk(self, sent: int, keep_alive: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(TOKEN)
            self._next(sent + 1, keep_alive)

    def _finish(self, keep_alive: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_end(self.chunks))
            if not keep_alive:
                self.transport.close()

    def _last(self, answer: bytes) -> None:
        assert self.transport is not None
        self.transport.write(answer)
        if not self.parser.should_keep_alive():
            self.transport.close()


def _metrics() -> bytes:
    """SGLang's /metrics as the simulator renders it for an idle EAGLE-3 engine of 0.5.23
    that finished one streamed request (so its histograms carry series). Needs a running
    loop (the simulated GPU's clock reads it)."""
    profile = load_profile("seed-coding")
    engine = Engine("instant-eagle", "eagle", profile, SharedGpu(SimClock(1.0)), 0,
                    engine_limits(profile, "eagle"))
    metrics = EngineMetrics(engine, MODEL, V0_5_23)
    metrics.observe_finished(True, 1000, 64, ttft_s=0.05, e2e_s=0.9, itl_s=0.013)
    text = metrics.render()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(text), text))


async def serve(host: str, port: int, chunks: int, gap_s: float) -> None:
    loop = asyncio.get_running_loop()
    ANSWERS[(b"GET", b"/metrics")] = _metrics()
    server = await loop.create_server(lambda: InstantProtocol(chunks, gap_s), host, port,
                                      backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=1, help="tokens per streamed answer")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="between streamed tokens")
    args = parser.parse_args()
    if args.chunks < 1 or args.gap_ms < 0:
        parser.error("--chunks must be at least 1 and --gap-ms at least 0")
    uvloop.run(serve(args.host, args.port, args.chunks, args.gap_ms / 1e3))


if __name__ == "__main__":
    main()
