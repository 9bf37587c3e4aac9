"""The policy side of an episode: what produces the assistant's messages.

A `Policy` completes a conversation in the OpenAI chat format. `OpenAIChatPolicy` talks to any OpenAI-compatible
`/v1/chat/completions` endpoint (k3's own server, vLLM, SGLang, a hosted API), so one environment evaluates any
model; `ScriptedPolicy` plays fixed messages, for tests and demonstrations.

A `Completion` carries the assistant message (`content`, `reasoning_content`, `tool_calls` with JSON-string
arguments), the finish reason, the token usage, and `extras`: whatever else the server returned that the RL
trainer needs (token ids, log-probs), stored with the trajectory as it came.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import httpx


class PolicyError(Exception):
    """The policy could not produce a message (server down, a refused request, a malformed response)."""


@dataclass
class Completion:
    message: dict                 # {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}
    finish_reason: str = "stop"
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    extras: dict = field(default_factory=dict)


class Policy(Protocol):
    def complete(self, messages: list[dict], tools: list[dict], *, max_tokens: int, temperature: float) -> Completion:
        """The next assistant message for `messages`, which may call `tools` (OpenAI `tools` specs)."""
        ...


def tool_call(name: str, arguments: dict | str, id: str | None = None) -> dict:
    """An OpenAI tool call; dict arguments are encoded as the JSON string the format carries."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": id or "", "type": "function", "function": {"name": name, "arguments": args}}


def assistant_message(content: str | None = None, tool_calls: list[dict] | None = None,
                      reasoning: str | None = None) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def normalize_message(msg: dict, call_id_prefix: str) -> dict:
    """An assistant message in the form the episode stores: role set, content a string or None, every tool call
    with an id unique in the message (`<prefix>_<i>` where the model gave none or repeated one), type "function" and
    its arguments as a string (other JSON values are encoded, so that a call with a list fails validation visibly)."""
    if not isinstance(msg, dict):
        raise PolicyError(f"an assistant message is a JSON object, got {type(msg).__name__}")
    out = {"role": "assistant", "content": msg.get("content")}
    if out["content"] is not None and not isinstance(out["content"], str):
        out["content"] = json.dumps(out["content"])
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning:
        out["reasoning_content"] = reasoning
    calls, seen = [], set()
    for i, c in enumerate(msg.get("tool_calls") or []):
        c = c if isinstance(c, dict) else {}
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        args = fn.get("arguments")
        if args is not None and not isinstance(args, str):
            args = json.dumps(args)
        cid = c.get("id")
        if not cid or cid in seen:      # results name their call by id: ids must be unique within the message
            cid = f"{call_id_prefix}_{i}"
        seen.add(cid)
        calls.append({"id": cid, "type": "function",
                      "function": {"name": str(fn.get("name") or ""), "arguments": args if args is not None else ""}})
    if calls:
        out["tool_calls"] = calls
    return out


def estimate_tokens(value) -> int:
    """About 4 characters per token (English prose and code under common BPE vocabularies): budgets and context
    limits need the order of magnitude, not a tokenizer."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return (len(text) + 3) // 4


class ScriptedPolicy:
    """Plays `script`: a list of assistant messages, one per call, or a function of the messages so far. Usage is
    estimated from the text. Every call's arguments are kept in `calls` for tests to inspect."""

    def __init__(self, script: list[dict] | Callable[[list[dict]], dict]):
        self.script = script
        self.calls: list[dict] = []

    def complete(self, messages, tools, *, max_tokens, temperature) -> Completion:
        self.calls.append({"messages": [dict(m) for m in messages], "tools": tools, "max_tokens": max_tokens,
                           "temperature": temperature})
        if callable(self.script):
            msg = self.script(messages)
        else:
            if len(self.calls) > len(self.script):
                raise PolicyError(f"the script has only {len(self.script)} messages")
            msg = self.script[len(self.calls) - 1]
        msg = normalize_message(msg, f"call_{len(self.calls)}")
        finish = "tool_calls" if msg.get("tool_calls") else "stop"
        return Completion(msg, finish, {"prompt_tokens": estimate_tokens(messages),
                                        "completion_tokens": estimate_tokens(msg)})


_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class OpenAIChatPolicy:
    """A model behind an OpenAI-compatible chat-completions endpoint. `base_url` is the server's root or its `/v1`.
    Connection errors, timeouts and statuses 408/429/5xx are retried `retries` times with exponential backoff;
    any other failure raises `PolicyError` with the status and the server's message."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff_s: float = 1.0, extra_body: dict | None = None,
                 transport: httpx.BaseTransport | None = None):
        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model = model
        self.retries = retries
        self.backoff_s = backoff_s
        self.extra_body = dict(extra_body or {})    # e.g. {"logprobs": True} for the trainer's log-probs
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers, transport=transport)

    def request_body(self, messages: list[dict], tools: list[dict], max_tokens: int, temperature: float) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                **self.extra_body}
        if tools:
            body["tools"] = tools
            body["tool_choice"] = "auto"
        return body

    def complete(self, messages, tools, *, max_tokens, temperature) -> Completion:
        body = self.request_body(messages, tools, max_tokens, temperature)
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                r = self._client.post(self.url, json=body)
            except httpx.TransportError as e:
                if last:
                    raise PolicyError(f"cannot reach {self.url} after {attempt + 1} attempts: "
                                      f"{type(e).__name__}: {e}") from e
            else:
                if r.status_code == 200:
                    return self._parse(r, messages)
                if r.status_code not in _RETRY_STATUS or last:
                    raise PolicyError(f"{self.url} answered {r.status_code}: {r.text[:500]}")
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _parse(self, r: httpx.Response, messages: list[dict]) -> Completion:
        try:
            data = r.json()
            choice = data["choices"][0]
            msg = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise PolicyError(f"{self.url} returned no completion ({type(e).__name__}: {e}): {r.text[:500]}") from e
        usage = data.get("usage") or {}
        extras = {k: choice[k] for k in ("logprobs", "token_ids") if choice.get(k) is not None}
        extras.update({k: data[k] for k in ("prompt_token_ids", "id") if data.get(k) is not None})
        message = normalize_message(msg, f"call_{data.get('id', 'x')}")
        # a server that reports no usage still spends tokens: estimate them, so that token budgets hold
        return Completion(message, choice.get("finish_reason") or "stop",
                          {"prompt_tokens": int(usage.get("prompt_tokens") or estimate_tokens(messages)),
                           "completion_tokens": int(usage.get("completion_tokens") or estimate_tokens(message))},
                          extras)

    def close(self) -> None:
        self._client.close()
