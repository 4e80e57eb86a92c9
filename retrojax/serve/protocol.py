"""The OpenAI chat-completions wire format: validating a request body, shaping replies and errors.

Validation is ours (not FastAPI's 422s) so that every bad request gets the standard error object
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, naming the offending field.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP_STRINGS = 4  # as OpenAI's API
# fields clients commonly send that change nothing here (n, logprobs and seed are checked below)
_IGNORED = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier", "stream_options",
                      "presence_penalty", "frequency_penalty", "logit_bias", "n", "logprobs",
                      "top_logprobs", "seed", "response_format", "tools", "tool_choice", "reasoning_effort"})
_KNOWN = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                    "top_k", "stop", "stream", "chat_template_kwargs"}) | _IGNORED


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request (messages normalized to ``{"role", "content": str}``)."""

    model: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    enable_thinking: bool | None = None  # chat_template_kwargs.enable_thinking (None: the server's default)


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number, got {value!r}", name, "invalid_type")
    if value > high or value < low or (low_open and value == low):
        side = "(" if low_open else "["
        raise _bad(f"'{name}' must be in {side}{low}, {high}], got {value}", name)
    return float(value)


def _int(body: Mapping[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {value!r}", name, "invalid_type")
    if value < low:
        raise _bad(f"'{name}' must be >= {low}, got {value}", name)
    return value


def _content(value: Any, i: int) -> str:
    """Message content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            text_part = isinstance(part, Mapping) and part.get("type") == "text"
            if not (text_part and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': str}}) "
                           "are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts, got {type(value).__name__}",
               f"messages[{i}].content", "invalid_type")


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages",
                   "invalid_type" if not isinstance(value, list) else "invalid_value")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]",
                       "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}",
                       f"messages[{i}].role")
        if "content" not in m or m["content"] is None:
            raise _bad(f"messages[{i}] has no content", f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m["content"], i)})
    return tuple(out)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _bad("'stop' must be a non-empty string or a list of non-empty strings", "stop", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    return tuple(dict.fromkeys(items))


def parse_chat_request(body: Any) -> ChatRequest:
    """A JSON body → :class:`ChatRequest`, or :class:`APIError` (400) naming the first bad field."""
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _bad(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model", "invalid_type")
    if body.get("n") not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    if body.get("logprobs"):
        raise _bad("logprobs are not returned by this server", "logprobs")
    if body.get("seed") is not None:
        raise _bad("per-request seeds are not supported (sampling keys are per decode step of the server)",
                   "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, Mapping) or set(template_kwargs) - {"enable_thinking"} \
            or not isinstance(template_kwargs.get("enable_thinking", False), bool):
        raise _bad("'chat_template_kwargs' supports only {'enable_thinking': bool}", "chat_template_kwargs")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    return ChatRequest(
        model=model, messages=_messages(body.get("messages")), max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(_int(body, "top_k", -1) or 0, 0),  # 0 or -1 (vLLM's spelling): no top-k
        stop=_stop(body.get("stop")), stream=stream, include_usage=bool(options.get("include_usage")),
        enable_thinking=template_kwargs.get("enable_thinking"),
    )


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, model: str, text: str, finish_reason: str, stop_reason: Any,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object (``stop_reason`` as vLLM: the stop string or token id)."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(cid: str, model: str, created: int, delta: dict[str, str], finish_reason: str | None = None,
               stop_reason: Any = None, usage_: dict[str, int] | None = None,
               no_choice: bool = False) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a stream (``no_choice``: the final usage-only chunk)."""
    choices = [] if no_choice else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                     "stop_reason": stop_reason, "logprobs": None}]
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
