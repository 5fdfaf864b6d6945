"""The client's request as the proxy reads it: the body in one buffer under a process-wide
budget, and `stream` read the way SGLang reads it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from starlette.types import Message

from specrouter.errors import RouterError
from specrouter.proxy.request import (
    BodyBudget,
    ClientGone,
    RequestHead,
    RouteKind,
    read_body,
    request_info,
)

HEAD = RequestHead([], None, b"id", None, None)


def receiver(chunks: Sequence[bytes], *, disconnect: bool = False) -> Any:
    messages: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or disconnect}
        for i, c in enumerate(chunks)]
    if disconnect:
        messages.append({"type": "http.disconnect"})

    async def receive() -> Message:
        return messages.pop(0)
    return receive


def read(chunks: Sequence[bytes], declared: int | None, budget: BodyBudget,
         limit: int = 1 << 20, disconnect: bool = False) -> bytes | bytearray:
    return asyncio.run(read_body(receiver(chunks, disconnect=disconnect), declared, limit,
                                 budget))


@pytest.mark.parametrize("declared", [None, 12])
def test_a_body_in_pieces_is_one_buffer_counted_once(declared: int | None) -> None:
    budget = BodyBudget(100)
    body = read([b"hello ", b"world", b"!"], declared, budget)
    assert body == b"hello world!" and isinstance(body, bytearray)
    assert budget.held == 12


def test_a_body_of_one_message_is_that_message() -> None:
    budget = BodyBudget(100)
    chunk = b'{"model": "m"}'
    assert read([chunk], len(chunk), budget) is chunk and budget.held == len(chunk)


def test_the_budget_refuses_with_503_and_retry_after_then_frees() -> None:
    budget = BodyBudget(20)
    read([b"x" * 8, b"x" * 8], 16, budget)
    with pytest.raises(RouterError) as refused:
        read([b"y" * 4, b"y" * 4], 8, budget)  # 16 held, 8 more would pass 20
    assert refused.value.status == 503 and refused.value.code == "overloaded"
    assert refused.value.headers == [(b"retry-after", b"1")]
    with pytest.raises(RouterError):  # without a declared length: refused while reading
        read([b"y" * 2, b"y" * 4], None, budget)
    assert budget.held == 16  # what the refused reads took was given back
    budget.give_back(16)
    assert len(read([b"y" * 10, b"y" * 10], 20, budget)) == 20


@pytest.mark.parametrize("declared", [None, 100])
def test_a_client_that_leaves_mid_body_gives_its_bytes_back(declared: int | None) -> None:
    budget = BodyBudget(1000)
    with pytest.raises(ClientGone):
        read([b"x" * 10, b"x" * 10], declared, budget, disconnect=True)
    assert budget.held == 0


def test_over_the_limit_is_413_and_nothing_stays_held() -> None:
    budget = BodyBudget(1000)
    with pytest.raises(RouterError) as refused:
        read([b"x" * 60, b"x" * 60], None, budget, limit=100)
    assert refused.value.status == 413 and budget.held == 0


class SGLangRequest(BaseModel):
    """The field as SGLang declares it (openai/protocol.py ChatCompletionRequest and
    CompletionRequest, sglang 0.5.10 and 0.5.23: `stream: bool = False`, lax mode)."""

    stream: bool = False


@pytest.mark.parametrize("value", [True, False, "true", "True", "yes", "on", "1", 1, 0, 1.0,
                                   "false", "no", "0", "off", "maybe", 2, None, [], {}])
def test_the_router_streams_exactly_when_sglang_would(value: object) -> None:
    body = json.dumps({"model": "m", "stream": value}).encode()
    routed = request_info(RouteKind.GENERATE, "/v1/chat/completions", body, HEAD).stream
    try:
        sglang = SGLangRequest.model_validate_json(body).stream
    except ValidationError:
        sglang = False  # SGLang answers 400: nothing streams
    assert routed is sglang


def test_headers_the_clients_connection_header_names_are_not_forwarded() -> None:
    from specrouter.proxy.request import parse_head

    head = parse_head({"headers": [(b"connection", b"x-hop, keep-alive"), (b"x-hop", b"1"),
                                   (b"x-end", b"2"), (b"keep-alive", b"timeout=5")]})
    assert head.forward == [(b"x-end", b"2")]
