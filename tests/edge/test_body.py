"""Whether a request's whole body is in, as the router's uvicorn protocol tells the app
(`BODY_COMPLETE`): yes when the head and body came together, no while the body is still
arriving (the proxy then bounds its read by the body timeout). A real uvicorn server on
loopback."""

from __future__ import annotations

import asyncio
from typing import Any

from specrouter.proxy.request import BODY_COMPLETE
from tests.edge.serving import guarded_server

HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 11\r\n\r\n")
BODY = b'{"a": "bc"}'


class RecordingApp:
    """Says what `BODY_COMPLETE` answered when the app started, then reads the body."""

    def __init__(self) -> None:
        self.looked = asyncio.Event()
        self.complete: list[bool] = []
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.complete.append(scope["extensions"][BODY_COMPLETE]())
        self.looked.set()
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


async def _exchange(app: RecordingApp, split: bool) -> bytes:
    async with guarded_server(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if split:
            writer.write(HEAD)
            await asyncio.wait_for(app.looked.wait(), 10)
            writer.write(BODY)
        else:
            writer.write(HEAD + BODY)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        return answer


def test_a_body_sent_with_its_head_is_complete_when_the_app_starts() -> None:
    app = RecordingApp()
    answer = asyncio.run(_exchange(app, split=False))
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert app.complete == [True] and app.bodies == [BODY]


def test_a_body_still_arriving_is_not_complete() -> None:
    app = RecordingApp()
    answer = asyncio.run(_exchange(app, split=True))
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert app.complete == [False] and app.bodies == [BODY]
