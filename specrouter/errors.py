"""Error bodies the router itself produces, in the formats clients already parse.

Before a response starts, errors use the OpenAI format (`{"error": {message, type, param,
code}}`) that the `openai` SDK turns into a typed exception. After an SSE stream started,
the status line is gone, so an upstream failure is reported the way SGLang reports its own
mid-stream errors: one `data: {"error": {...}}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

JSON_HEADERS: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class RouterError(Exception):
    """An error the router answers itself, before any upstream byte reached the client."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # Sent with the answer: `retry-after` when the router is out of capacity.
        self.headers: list[tuple[bytes, bytes]] = (
            [] if retry_after_s is None else [(b"retry-after", str(retry_after_s).encode())])

    def body(self) -> bytes:
        return openai_error_body(self.status, self.message, param=self.param, code=self.code)


def openai_error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    error: dict[str, Any] = {
        "message": message,
        "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code if code is not None else status,
    }
    return json.dumps({"error": error}).encode()


def sse_error_event(message: str, *, error_type: str = "upstream_error", code: int = 502) -> bytes:
    """SGLang's mid-stream error event followed by the stream terminator."""
    error = {"object": "error", "message": message, "type": error_type, "code": code}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"


def describe_validation_error(
    exc: ValidationError, *, subject: str | None = None, separator: str = "; "
) -> str:
    """Every problem of `exc` as `field.path: message`, joined by `separator`.

    A problem of the whole object is named `subject` (or given bare when that is None);
    pydantic's "Value error, " prefix of a validator's message is dropped.
    """
    problems: list[str] = []
    for error in exc.errors(include_url=False, include_input=False):
        location = ".".join(str(part) for part in error["loc"]) or subject
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{location}: {message}" if location else message)
    return separator.join(problems)
