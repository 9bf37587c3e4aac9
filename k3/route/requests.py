"""What the router reads of a request: its body, checked as `k3 serve` checks it (k3.serve.protocol's schemas), so
that a malformed request is answered here and never reaches a backend; the session key that picks its instance;
and an estimate of its prompt tokens that picks its request class.

The session key, in order of precedence:
1. the session header (`X-Session-Id` by default), when the client sends one;
2. the body's `user` field, when given;
3. the prompt's first `prefix_chars` characters: a completion's prompt text (or its first `prefix_chars` token
   ids); a chat's messages in order, each as its role, a newline, its text (a string content, or the `text` of its
   text parts, joined) and a newline. Turns of one conversation that grow by a suffix share this prefix once their
   first prompt is at least `prefix_chars` long, so it should be no longer than one hash block of the backends'
   prefix cache in characters (`k3 serve --hash-block-tokens`, default 512 tokens, ~2,000 characters of English
   for a BPE); a shorter prompt has no full block in any prefix cache, so nothing is lost when it moves.

The prompt-token estimate (the router has no tokenizer): a token-id prompt's length; a text's UTF-8 bytes divided
by `bytes_per_token` (rounded up); a chat's message text so, plus CHAT_MARKUP_TOKENS per message. With the byte
tokenizer and bytes_per_token 1 it is exact for completions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pydantic import ValidationError

from k3.route.defaults import DEFAULT_BYTES_PER_TOKEN, DEFAULT_PREFIX_CHARS, DEFAULT_SESSION_HEADER
from k3.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, _validation_message, parse_json_body

CHAT_MARKUP_TOKENS = 4  # the markup of one chat message: open, role tag, separator, end of message


@dataclass(frozen=True)
class KeyOptions:
    session_header: str = DEFAULT_SESSION_HEADER
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN


@dataclass(frozen=True)
class RoutedRequest:
    raw: bytes  # forwarded unchanged
    stream: bool
    session_key: str
    key_source: str  # "header", "user" or "prompt"
    prompt_tokens: int  # estimated


def _message_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def check_messages(messages: list) -> None:
    """The shape of a chat's messages: objects with a string role, and a content that is a string, a list of parts
    or null. The rest (roles, parts, tool calls) is the backend's chat template's to judge."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content', got "
                                f"{type(m).__name__}", param=f"messages[{i}]")
        if "role" not in m:
            raise APIError(400, f"'messages[{i}].role' is a required field", param=f"messages[{i}].role")
        if not isinstance(m["role"], str):
            raise APIError(400, f"'messages[{i}].role' must be a string, got {type(m['role']).__name__}",
                           param=f"messages[{i}].role")
        c = m.get("content")
        if not (c is None or isinstance(c, str) or (isinstance(c, list) and all(isinstance(p, dict) for p in c))):
            raise APIError(400, f"'messages[{i}].content' must be a string, a list of content parts or null, got "
                                f"{type(c).__name__}", param=f"messages[{i}].content")


def parse_request(raw: bytes, chat: bool, headers, opts: KeyOptions) -> RoutedRequest:
    """The routed view of a POST /v1/completions (`chat` False) or /v1/chat/completions body; raises APIError (400)
    for a body k3 serve would refuse as malformed (bad JSON, wrong types, missing fields)."""
    try:
        value = parse_json_body(raw)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} at character {e.pos}") from None
    schema = ChatCompletionRequest if chat else CompletionRequest
    try:
        body = schema.model_validate(value)
    except ValidationError as e:
        message, param = _validation_message(list(e.errors()))
        raise APIError(400, message, param=param) from None
    if chat:
        check_messages(body.messages)
        text = "".join(f"{m['role']}\n{_message_text(m.get('content'))}\n" for m in body.messages)
        nbytes = sum(len(_message_text(m.get("content")).encode("utf-8")) for m in body.messages)
        tokens = math.ceil(nbytes / opts.bytes_per_token) + CHAT_MARKUP_TOKENS * len(body.messages)
        prefix = text[:opts.prefix_chars]
    elif isinstance(body.prompt, str):
        tokens = math.ceil(len(body.prompt.encode("utf-8")) / opts.bytes_per_token)
        prefix = body.prompt[:opts.prefix_chars]
    else:
        tokens = len(body.prompt)
        prefix = ",".join(map(str, body.prompt[:opts.prefix_chars]))
    session = headers.get(opts.session_header)
    if session:
        key, source = f"session:{session}", "header"
    elif body.user:
        key, source = f"user:{body.user}", "user"
    else:
        key, source = f"prompt:{prefix}", "prompt"
    return RoutedRequest(raw=raw, stream=bool(body.stream), session_key=key, key_source=source,
                         prompt_tokens=max(1, tokens))
