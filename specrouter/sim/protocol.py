"""SGLang's JSON shapes: request parsing and response/chunk builders.

Field names and nesting follow SGLang's python/sglang/srt/entrypoints/openai/protocol.py,
serving_{chat,completions}.py and sse_utils.py (docs/simulator.md cites the lines). Pydantic
models are dumped with model_dump_json(), every field present, nulls included; 0.5.23 encodes
chat chunks with msgspec structs that omit None fields (sse_utils.py:13-99).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from specrouter.sim import prefix
from specrouter.sim.text import chat_prompt_tokens, count_text_tokens

EOS_TOKEN_ID = 128009  # Llama-3 <|eot_id|>: what SGLang reports as matched_stop on EOS


# ErrorResponse.type as SGLang writes it: request validation (FastAPI's RequestValidationError
# handler, HTTPStatus phrase), a ValueError from the tokenizer (serving_base.py
# create_error_response default), an HTTPException such as the queue-full 503 (str(status)),
# an abort with a status inside a stream (HTTPStatus name)
VALIDATION_ERROR = "Bad Request"
VALUE_ERROR = "BadRequestError"
QUEUE_FULL_MESSAGE = "The request queue is full."


class BadRequest(ValueError):
    """The request body is invalid: SGLang answers 400 in its flat error format."""


def error_body(message: str, err_type: str = VALUE_ERROR, code: int = 400) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def sse_error(message: str, err_type: str, code: int) -> bytes:
    """create_streaming_error_response: json.dumps with its default separators."""
    return b"data: " + json.dumps({"error": error_body(message, err_type, code)}).encode() + \
        b"\n\n"


@dataclass(frozen=True)
class GenParams:
    """What the engine needs from any of the three generation endpoints."""

    prompt_tokens: int
    prompt_key: str  # feeds the deterministic output
    max_new_tokens: int | None
    ignore_eos: bool
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str
    rid: str | None = None  # the caller's request id (SGLang's `rid` field)
    priority: int | None = None
    blocks: prefix.Blocks | None = None  # the prompt's prefix-cache keys


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key}: Input should be a valid integer")
    if v < 0:
        raise BadRequest(f"{key} must be non-negative")
    return v


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise BadRequest("stop: Input should be a valid string or list of strings")


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _bool(body: dict[str, Any], key: str) -> bool:
    """A `bool` field as SGLang's (non-strict) pydantic models read it: lax mode takes 0/1
    and the strings pydantic knows (openai/protocol.py `stream: bool = False`)."""
    v = body.get(key, False)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise BadRequest(f"{key}: Input should be a valid boolean")


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: Input should be a valid dictionary")
    return bool(opts.get("include_usage", False))


def parse_chat(body: Any, chars_per_token: float, default_model: str) -> GenParams:
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: Field required (a non-empty list)")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("messages: every message needs a 'role'")
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    _n_is_one(body)
    key = json.dumps(messages, sort_keys=True, default=str)
    tokens, blocks = _chat_prompt(messages, _bool(body, "continue_final_message"),
                                  chars_per_token)
    return GenParams(tokens, key, max_tokens,
                     _bool(body, "ignore_eos"), _stop(body.get("stop")), _bool(body, "stream"),
                     _include_usage(body), str(body.get("model") or default_model),
                     blocks=blocks)


def _chat_prompt(messages: list[Any], continue_final: bool, cpt: float
                 ) -> tuple[int, prefix.Blocks]:
    """The prompt's tokens and blocks. With `continue_final_message` and a last message
    of the assistant with text content, that text continues the prompt after the
    assistant's header instead of closing a turn (SGLang 0.5.23 `serving_chat.py`
    `_handle_last_assistant_message`): the prompt of the request whose answer it is,
    followed by the answer so far."""
    last = messages[-1]
    if continue_final and last.get("role") == "assistant" and isinstance(
            last.get("content"), str):
        head, text = messages[:-1], last["content"]
        return (chat_prompt_tokens(head, cpt) + count_text_tokens(text, cpt),
                prefix.chat_prompt(head, cpt).with_output(text))
    return chat_prompt_tokens(messages, cpt), prefix.chat_prompt(messages, cpt)


def parse_completion(body: Any, chars_per_token: float, default_model: str) -> GenParams:
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = count_text_tokens(prompt, chars_per_token)
        blocks = prefix.text_prompt(prompt, chars_per_token)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens = len(prompt)
        blocks = prefix.ids_prompt(prompt)
    else:
        raise BadRequest("prompt: Field required (a string, or a list of token ids)")
    _n_is_one(body)
    max_tokens = _opt_int(body, "max_tokens")
    return GenParams(tokens, json.dumps(prompt), 16 if max_tokens is None else max_tokens,
                     _bool(body, "ignore_eos"), _stop(body.get("stop")), _bool(body, "stream"),
                     _include_usage(body), str(body.get("model") or default_model),
                     blocks=blocks)


def parse_generate(body: Any, chars_per_token: float, default_model: str) -> GenParams:
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str):
        tokens, key = count_text_tokens(text, chars_per_token), text
        blocks = prefix.text_prompt(text, chars_per_token)
    elif isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        tokens, key = len(ids), json.dumps(ids)
        blocks = prefix.ids_prompt(ids)
    else:
        raise BadRequest("Either text or input_ids should be provided.")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = _opt_int(params, "max_new_tokens")
    return GenParams(tokens, key, 128 if max_new is None else max_new,
                     _bool(params, "ignore_eos"), _stop(params.get("stop")), _bool(body, "stream"),
                     False, default_model, blocks=blocks)


def _rid(body: dict[str, Any]) -> str | None:
    rid = body.get("rid")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid:
        raise BadRequest("rid: Input should be a valid string")
    return rid


def with_ids(params: GenParams, body: dict[str, Any]) -> GenParams:
    """The `rid` and `priority` fields every generation endpoint accepts."""
    priority = _opt_int(body, "priority") if "priority" in body else None
    return GenParams(**{**params.__dict__, "rid": _rid(body), "priority": priority})


def _n_is_one(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (None, 1):
        raise BadRequest("n > 1 is not supported by this server")


# --- responses -------------------------------------------------------------------------------

def usage(prompt: int, completion: int, completion_details: bool = False,
          prompt_details: dict[str, Any] | None = None) -> dict[str, Any]:
    """UsageInfo; 0.5.23 adds completion_tokens_details (protocol.py:221-229).
    `prompt_details` is `{"cached_tokens": N}` with --enable-cache-report (cache_details)."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                           "completion_tokens": completion,
                           "prompt_tokens_details": prompt_details, "reasoning_tokens": 0}
    if completion_details:
        out["completion_tokens_details"] = None
    return out


def cache_details(enabled: bool, cached: int, omit_zero: bool) -> dict[str, Any] | None:
    """UsageInfo.prompt_tokens_details: None without --enable-cache-report; with it
    PromptTokensDetails(cached_tokens=N), multimodal fields dropped (0.5.23
    usage_processor.py:37-44, protocol.py:195-213); 0.5.10 leaves it None when N is 0
    (usage_processor.py 0.5.10:13-15)."""
    if not enabled or (omit_zero and cached <= 0):
        return None
    return {"cached_tokens": cached}


def matched_stop(finish_reason: str, stop_str: str | None) -> int | str | None:
    if finish_reason != "stop":
        return None
    return stop_str if stop_str is not None else EOS_TOKEN_ID


def chat_response(rid: str, model: str, text: str, finish: str, matched: int | str | None,
                  prompt: int, completion: int,
                  prompt_details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None,
                        "tool_calls": None},
            "logprobs": None, "finish_reason": finish, "matched_stop": matched,
            "hidden_states": None,
        }],
        "usage": usage(prompt, completion, prompt_details=prompt_details),
        "metadata": {"weight_version": "default"},
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any],
               finish: str | None = None, matched: int | str | None = None,
               omit_none: bool = False) -> dict[str, Any]:
    """One chat chunk, never with usage (the finish chunk has none either). 0.5.10: pydantic,
    every field (serving_chat.py:714-848); 0.5.23: msgspec StreamChunk/StreamDelta with None
    omitted, but `reasoning_content` always present and StreamChoice complete."""
    if omit_none:
        short = {"reasoning_content": None, **{k: v for k, v in delta.items() if v is not None}}
        return {
            "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": short, "logprobs": None,
                         "finish_reason": finish, "matched_stop": matched}],
        }
    full_delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None,
                  **delta}
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": full_delta, "logprobs": None, "finish_reason": finish,
                     "matched_stop": matched}],
        "usage": None,
    }


def completion_response(rid: str, model: str, text: str, finish: str,
                        matched: int | str | None, prompt: int, completion: int,
                        prompt_details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "matched_stop": matched, "hidden_states": None}],
        "usage": usage(prompt, completion, prompt_details=prompt_details),
        "metadata": {"weight_version": "default"},
    }


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish: str | None = None, matched: int | str | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "matched_stop": matched}],
        "usage": None,
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt: int,
                completion: int, completion_details: bool = False,
                prompt_details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt, completion, completion_details, prompt_details)}


def generate_finish(finish: str, matched: int | str | None, completion: int) -> dict[str, Any]:
    if finish == "length":
        return {"type": "length", "length": completion}
    if finish == "abort":
        return {"type": "abort", "message": "Aborted"}
    return {"type": "stop", "matched": matched}


def queue_full_finish() -> dict[str, Any]:
    """The scheduler's abort when the waiting queue is full (scheduler.py:3552-3595)."""
    return {"type": "abort", "status_code": 503, "message": QUEUE_FULL_MESSAGE}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
