"""The HTTP API's request schemas and error shape (OpenAI-compatible)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator


MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


# =====================================================================================================================
# Errors


class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI/pydantic validation errors -> (message naming the field(s), param of the first)."""
    parts, first_param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        kind = e.get("type", "")
        if kind == "json_invalid":
            detail = str((e.get("ctx") or {}).get("error", "") or "")
            where = f" at character {loc[0]}" if loc and loc[0].isdigit() else ""
            return f"the request body is not valid JSON{': ' + detail if detail else ''}{where}", None
        if not loc:
            if kind == "missing":
                parts.append("the request body is missing: send a JSON object")
            else:
                parts.append("the request body must be a JSON object")
            continue
        param = ".".join(loc)
        first_param = first_param or param
        msg = str(e.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if kind == "missing":
            parts.append(f"'{param}' is a required field")
        else:
            parts.append(f"'{param}': {msg}")
    return "; ".join(parts) or "invalid request", first_param


# =====================================================================================================================
# Request bodies as JSON: valid text, bounded nesting

MAX_JSON_DEPTH = 64  # far more than any request needs; deeper bodies are refused before anything recurses into them
_PLAIN_TYPES = {int, float, bool, type(None)}


def _reject_constant(name: str):
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json_body(body: bytes) -> Any:
    """The JSON value of a request body. Raises json.JSONDecodeError for a syntax error, and APIError (400) for a
    body that parses but that the endpoints must not see: invalid UTF-8, lone surrogates (from escapes like
    "\\ud800"; the tokenizer cannot take them and no response could quote them), NaN/Infinity, numbers too long
    for Python, nesting deeper than MAX_JSON_DEPTH."""
    try:
        text, invalid_utf8 = body.decode("utf-8-sig"), False
    except UnicodeDecodeError:
        # Invalid bytes become U+DC80..U+DCFF, so that the check below can name the field that holds them.
        text, invalid_utf8 = body.decode("utf-8", "surrogateescape"), True
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise APIError(400, f"the request body nests arrays and objects too deeply (at most {MAX_JSON_DEPTH} "
                            f"levels are allowed)") from None
    except ValueError:  # an integer literal over Python's digit limit
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise APIError(400, f"the request body has a number with more than {limit} digits") from None
    problem = check_json_text(value, invalid_utf8)
    if problem is not None:
        raise APIError(400, problem[0], param=problem[1])
    return value


def _text_problem(s: str, where: str, invalid_utf8: bool) -> str | None:
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        i, cp = e.start, ord(s[e.start])
    if invalid_utf8 and 0xDC80 <= cp <= 0xDCFF:
        return (f"{where} is not valid UTF-8: byte 0x{cp - 0xDC00:02X} at character {i}; the request body must be "
                f"UTF-8")
    return f"{where} contains a lone surrogate (U+{cp:04X}) at character {i}; text must be valid Unicode"


def check_json_text(value: Any, invalid_utf8: bool = False) -> tuple[str, str | None] | None:
    """(message, param) for the first string or key of a parsed body that is not valid Unicode, or for nesting
    deeper than MAX_JSON_DEPTH; None when the body is fine. Iterative, so any depth is safe to walk. Messages name
    the place (e.g. `messages[0].content`) but never quote the bad text, which could not be encoded."""
    stack = [(value, "", 0, None)]
    while stack:
        v, path, depth, param = stack.pop()
        if isinstance(v, str):
            msg = _text_problem(v, path or "the request body", invalid_utf8)
            if msg is not None:
                return msg, param
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            shown = path if len(path) <= 60 else path[:60] + "..."
            return (f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
                    f"(at {shown or 'the top'})"), param
        if isinstance(v, list):
            if set(map(type, v)) <= _PLAIN_TYPES:  # e.g. token ids: nothing inside to check
                continue
            items = [(x, f"{path}[{i}]", depth + 1, param) for i, x in enumerate(v) if type(x) not in _PLAIN_TYPES]
        else:
            items = []
            for k, x in v.items():
                msg = _text_problem(k, f"a key of {path or 'the request body'}", invalid_utf8)
                if msg is not None:
                    return msg, param
                shown = k if len(k) <= 40 else k[:40] + "..."
                items.append((x, f"{path}.{shown}" if path else shown, depth + 1, param if path else k))
        stack.extend(reversed(items))  # reversed: the first problem in document order is reported
    return None


# =====================================================================================================================
# Request bodies

Prob = Annotated[float, Field(strict=True, gt=0, le=1)]


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Field(strict=True)] = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(strict=True)]
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0, le=2)] | None = None
    top_p: Prob | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None  # extension; 0 or -1: no top-k cut
    seed: Annotated[int, Field(strict=True, ge=-(2**63), le=2**64 - 1)] | None = None
    stop: Any = None
    stream: Annotated[bool, Field(strict=True)] | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(strict=True, ge=1)] | None = 1
    presence_penalty: Annotated[float, Field(strict=True, ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2, le=2)] | None = None
    logit_bias: dict | None = None
    user: Annotated[str, Field(strict=True)] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(v)}")
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class CompletionRequest(_SamplingFields):
    prompt: Any
    # 0 is allowed here (with echo: score the prompt, generate nothing); the endpoint rejects 0 without echo.
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Annotated[bool, Field(strict=True)] | None = False
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None
    suffix: Annotated[str, Field(strict=True)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v):
        # A string or a list of token ids; a batch of exactly one of either is unwrapped.
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                return v
            if all(isinstance(x, (str, list)) for x in v):
                raise ValueError("batched prompts are not supported: send one prompt per request")
        raise ValueError("prompt must be a string or a list of integer token ids")


class ChatCompletionRequest(_SamplingFields):
    messages: Any
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    logprobs: Annotated[bool, Field(strict=True)] | None = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None
    response_format: Any = None
    reasoning_effort: Any = None
    chat_template_kwargs: Any = None  # vLLM's: {"thinking": bool} or {"enable_thinking": bool}

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, v):
        if not isinstance(v, list):
            raise ValueError("messages must be a list of message objects")
        if not v:
            raise ValueError("messages must contain at least one message")
        return v
