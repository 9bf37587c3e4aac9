"""The chat endpoint's options and replies: tool calling, reasoning and response formats in OpenAI's shape (the
conventions of vLLM and SGLang), on top of the chat template (k3.serve.chat).

Request side: `chat_options` checks the request's tools, tool_choice, parallel_tool_calls, response_format,
reasoning_effort and chat_template_kwargs (an APIError names the parameter), `ChatOptions.render` builds the
prompt, and `ChatOptions.constraint` gives the decoding grammar of a forced call (tool_choice "required" or a
named function: k3.serve.chat_constrain). Thinking mode (generation prefix [open]think[sep]) is chosen by chat_template_kwargs {"thinking": bool}
(or vLLM's "enable_thinking"), else by the presence of reasoning_effort.

Reply side: `ChatTurn` feeds the generated token ids to the streaming parser (markup ids are markup, other ids
literal text) and `ReplyAssembler` turns its events into OpenAI deltas (reasoning_content, content, tool_calls) and
the final message; both forms come from the same events, so streamed deltas reassemble to the non-streamed message.
What the model wrote wrong is never dropped silently: every parse error (a malformed element, bad JSON in a
json-typed argument, an unknown channel, text outside any channel, an unclosed call), every broken constraint
(tool_choice, parallel_tool_calls=false, an undeclared tool) goes into the message's non-standard
`tool_call_errors` list, and a content that breaks the response_format into `response_format_errors`. Calls stay in
`tool_calls` unless they have no tool name (their error says so).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from k3.serve.chat import AssistantParser, ChatEvent, ChatTemplate, markup_ids, render_chat_segments
from k3.serve.chat_constrain import ToolCallConstraint
from k3.serve.chat_render import attr_value_ok, check_tools, loads_json, tool_names
from k3.serve.chat_schema import check_schema, json_short, schema_errors
from k3.serve.chat_template import RESPONSE, THINK, TOOLS
from k3.serve.detok import byte_level, decode_growing
from k3.serve.protocol import APIError

THINKING_KWARGS = ("thinking", "enable_thinking")  # chat_template_kwargs keys that select the mode
_RENDER_PARAMS = ("tools", "tool_choice", "response_format", "reasoning_effort")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# =====================================================================================================================
# Requests


@dataclass(frozen=True)
class ChatOptions:
    """A chat request's options, checked. `tool_choice`: None (auto), "none", "required" or a tool's name."""

    tools: list | None = None
    tool_choice: str | None = None
    named: bool = False  # tool_choice names a function
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # None for text
    reasoning_effort: str | None = None
    thinking: bool = False

    def render(self, messages, template: ChatTemplate):
        """The prompt's segments; a bad message raises APIError naming its field."""
        choice = {"type": "function", "function": {"name": self.tool_choice}} if self.named else self.tool_choice
        try:
            return render_chat_segments(messages, template, tools=self.tools, tool_choice=choice,
                                        response_format=self.response_format, reasoning_effort=self.reasoning_effort,
                                        thinking=self.thinking, parallel_tool_calls=self.parallel_tool_calls)
        except ValueError as e:
            msg = str(e)
            param = next((p for p in _RENDER_PARAMS if msg.startswith(p)), "messages")
            raise APIError(400, msg, param=param) from None


    def constraint(self, tokenizer, template: ChatTemplate, max_tokens: int, eos_id: int | None,
                   param: str = "max_tokens"):
        """The decoding constraint that makes a "required" or named tool_choice hold (k3.serve.chat_constrain),
        or None when the request forces no call or the tokenizer lacks the markup as special tokens. APIError
        when max_tokens cannot hold the shortest call."""
        if not (self.named or self.tool_choice == "required") or markup_ids(tokenizer, template) is None:
            return None
        allowed = [self.tool_choice] if self.named else tool_names(self.tools)
        params = {}
        for tool in self.tools:
            name = tool["function"]["name"]
            if name in allowed:
                props = (tool["function"].get("parameters") or {}).get("properties")
                props = props if isinstance(props, dict) else {}
                params[name] = {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()
                                if k and attr_value_ok(k, template)}
        c = ToolCallConstraint(tokenizer, template, params, self.thinking, max_tokens, eos_id)
        if c.min_tokens() > max_tokens:
            raise APIError(400, f"{param} = {max_tokens} is too small: tool_choice forces a call, and the "
                                f"shortest one takes {c.min_tokens()} tokens", param=param)
        return c


def chat_options(template: ChatTemplate, tools=None, tool_choice=None, parallel_tool_calls=None,
                 response_format=None, reasoning_effort=None, chat_template_kwargs=None) -> ChatOptions:
    """The request's options, checked; APIError (400) names the parameter, its value and what is allowed."""
    if tools is not None:
        try:
            tools = check_tools(tools, "tools", template)
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
    names = tool_names(tools)
    named = False
    if tool_choice is None or tool_choice == "auto":
        tool_choice = None
    elif tool_choice in ("none", "required"):
        if tool_choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools: declare at least one", param="tool_choice")
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which tools does not declare (declared: "
                                f"{names})", param="tool_choice")
        tool_choice, named = name, True
    else:
        raise APIError(400, f"tool_choice = {json_short(tool_choice)} is invalid: 'auto', 'none', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    fmt = _response_format(response_format)
    thinking = _thinking(chat_template_kwargs)
    if reasoning_effort is not None:
        levels = list(template.effort_instructions)
        if reasoning_effort not in levels:
            raise APIError(400, f"reasoning_effort = {json_short(reasoning_effort)} is invalid: one of {levels} (this "
                                "model's levels) or null", param="reasoning_effort")
        if thinking is False:
            raise APIError(400, f"reasoning_effort = {reasoning_effort!r} needs thinking mode, but "
                                "chat_template_kwargs turns thinking off: drop one of them", param="reasoning_effort")
    if thinking is None:
        thinking = reasoning_effort is not None
    return ChatOptions(tools, tool_choice, named, parallel_tool_calls, fmt, reasoning_effort, thinking)


def _thinking(kwargs) -> bool | None:
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise APIError(400, f"chat_template_kwargs must be an object like {{\"thinking\": true}}, got {json_short(kwargs)}",
                       param="chat_template_kwargs")
    unknown = sorted(set(kwargs) - set(THINKING_KWARGS))
    if unknown:
        raise APIError(400, f"chat_template_kwargs has unknown keys {unknown} (known: {list(THINKING_KWARGS)}, "
                            "booleans that select thinking mode)", param="chat_template_kwargs")
    given = {k: v for k, v in kwargs.items() if v is not None}
    for k, v in given.items():
        if not isinstance(v, bool):
            raise APIError(400, f"chat_template_kwargs.{k} = {json_short(v)} is invalid: true or false",
                           param="chat_template_kwargs")
    if len(set(given.values())) > 1:
        raise APIError(400, f"chat_template_kwargs.thinking and .enable_thinking disagree ({given}): give one",
                       param="chat_template_kwargs")
    return next(iter(given.values()), None)


def _response_format(fmt) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise APIError(400, f"response_format = {json_short(fmt)} is invalid: its type is 'text', 'json_object' or "
                            "'json_schema'", param="response_format")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise APIError(400, "response_format.json_schema must be an object like {\"name\": ..., \"schema\": {...}}, "
                            f"got {json_short(js)}", param="response_format")
    if "name" in js and not isinstance(js["name"], str):
        raise APIError(400, f"response_format.json_schema.name must be a string, got {json_short(js['name'])}",
                       param="response_format")
    schema = js.get("schema", {})
    try:
        check_schema(schema, "response_format.json_schema.schema")
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from None
    return {"type": "json_schema", "json_schema": js}


def response_format_errors(content: str | None, fmt: dict | None) -> list[str]:
    """Where the reply's content breaks the requested response_format (None: text, nothing to check)."""
    if fmt is None:
        return []
    if content is None:
        return [f"response_format is {fmt['type']} but the reply has no content"]
    try:
        value = loads_json(content)
    except ValueError as e:
        return [f"response_format is {fmt['type']} but the content is not valid JSON: {e}"]
    if fmt["type"] == "json_object":
        return [] if isinstance(value, dict) else [f"response_format is json_object but the content is a JSON "
                                                   f"{type(value).__name__}, not an object"]
    return schema_errors(value, fmt["json_schema"].get("schema", {}))


# =====================================================================================================================
# Replies


class ReplyAssembler:
    """Parser events -> OpenAI chat deltas, and the whole assistant message they add up to.

    Deltas: {"reasoning_content": text}, {"content": text}, {"tool_calls": [...]} (a call's first delta has its
    index among the message's calls, id, type and name with arguments "", later ones the index and an arguments
    piece), {"tool_call_errors": [message]}, {"response_format_errors": [message]}. A call without a tool name
    gets no delta (the parser's error names it)."""

    def __init__(self, options: ChatOptions, new_id=new_call_id):
        self.options, self.new_id = options, new_id
        self.reasoning: list[str] | None = [] if options.thinking else None
        self.content: list[str] | None = None if options.thinking else []
        self.calls: list[dict] = []  # OpenAI tool calls, in order
        self.slot: dict[int, int] = {}  # the parser's call index -> position in self.calls
        self.errors: list[str] = []
        self.format_errors: list[str] = []

    def events(self, evs: list[ChatEvent]) -> list[dict]:
        out: list[dict] = []
        for ev in evs:
            if ev.kind == "reasoning":
                self.reasoning = (self.reasoning or []) + [ev.text]
                out.append({"reasoning_content": ev.text})
            elif ev.kind == "content":
                self.content = (self.content or []) + [ev.text]
                out.append({"content": ev.text})
            elif ev.kind == "tool_call_start" and ev.name:
                k = self.slot[ev.index] = len(self.calls)
                call = {"id": self.new_id(), "type": "function", "function": {"name": ev.name, "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": ev.name, "arguments": ""}}]})
            elif ev.kind == "tool_call_arguments" and ev.index in self.slot and ev.text:
                k = self.slot[ev.index]
                self.calls[k]["function"]["arguments"] += ev.text
                out.append({"tool_calls": [{"index": k, "function": {"arguments": ev.text}}]})
            elif ev.kind == "error":
                out.append(self._error(ev.text))
        return out

    def _error(self, msg: str) -> dict:
        self.errors.append(msg)
        return {"tool_call_errors": [msg]}

    def opened_response(self) -> None:
        """The output opened the response channel (its content is "" even when it stays empty)."""
        if self.content is None:
            self.content = []

    def finish(self) -> list[dict]:
        """The checks of the whole reply against the request: tool_choice, parallel_tool_calls, declared tools,
        response_format."""
        o, out = self.options, []
        names = [c["function"]["name"] for c in self.calls]
        declared = tool_names(o.tools)
        if o.tool_choice == "none" and names:
            out.append(self._error(f"tool_choice is 'none' but the model called {names}"))
        elif o.tool_choice == "required" and not names:
            out.append(self._error("tool_choice is 'required' but the model called no tool"))
        elif o.named and (not names or any(n != o.tool_choice for n in names)):
            out.append(self._error(f"tool_choice names {o.tool_choice!r} but the model called {names}"))
        if not o.parallel_tool_calls and len(names) > 1:
            out.append(self._error(f"parallel_tool_calls is false but the model made {len(names)} calls {names}; "
                                   "all are returned"))
        unknown = [n for n in names if n not in declared]
        if unknown:
            out.append(self._error(f"the model called undeclared tools {unknown} (declared: {declared})"))
        self.format_errors = response_format_errors(self.content_value(), o.response_format)
        if self.format_errors:
            out.append({"response_format_errors": list(self.format_errors)})
        return out

    def content_value(self) -> str | None:
        """The message's content: the response channel's text; None without one, or when it is empty and the
        message has tool calls."""
        text = None if self.content is None else "".join(self.content)
        return None if (text == "" and self.calls) else text

    def message(self) -> dict:
        m = {"role": "assistant", "content": self.content_value()}
        if self.reasoning is not None:
            m["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            m["tool_calls"] = self.calls
        if self.errors:
            m["tool_call_errors"] = list(self.errors)
        if self.format_errors:
            m["response_format_errors"] = list(self.format_errors)
        return m

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when a message that ended by itself has calls; else the engine's ("stop" or "length")."""
        return "tool_calls" if engine_reason == "stop" and self.calls else engine_reason


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of the same text field joined (fewer chunks, the same sum)."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and len(d) == 1 and d.keys() == prev.keys():
            (k, v), = d.items()
            if k in ("reasoning_content", "content"):
                prev[k] += v
                continue
            if k in ("tool_call_errors", "response_format_errors"):
                prev[k] = prev[k] + v
                continue
        out.append(dict(d))
    return out


class ChatTurn:
    """The reply side of one chat completion: the generated token ids in, OpenAI deltas and the message out.

    `stops`: whether the request has stop strings; the engine then cuts or holds back text at them, and only the
    ids whose text the engine has released are parsed (so a stop string ends the parse where it ends the text)."""

    def __init__(self, options: ChatOptions, template: ChatTemplate, tokenizer, stops: bool):
        self.tokenizer, self.stops = tokenizer, stops
        self.parser = AssistantParser(template, prefix=THINK if options.thinking else RESPONSE, tokenizer=tokenizer)
        self.reply = ReplyAssembler(options)
        self.ids: list[int] = []
        self.fed = 0
        self._incremental = byte_level(tokenizer)
        self._decoded: tuple[int, str] = (0, "")  # k3.serve.detok.decode_growing's state for self.ids

    def update(self, new_ids: list[int], text: str, finished: bool = False,
               engine_reason: str | None = None) -> list[dict]:
        """Add the engine's new ids (`text`: the request's text released so far); when `finished`, end the parse
        (`engine_reason`: "stop" or "length") and check the reply against the request. Returns the new deltas."""
        self.ids.extend(new_ids)
        n = len(self.ids)
        if self.stops:
            full, self._decoded = decode_growing(self.tokenizer, self._incremental, self.ids, self._decoded)
            if len(full) > len(text):
                # the text is cut or held back at a stop string: the longest prefix of ids within it
                lo, hi = self.fed, n
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if len(self.tokenizer.decode(self.ids[:mid])) <= len(text) else (lo, mid - 1)
                n = lo
        new, self.fed = self.ids[self.fed:n], n
        deltas = self.reply.events(self.parser.feed_ids(new))
        if finished:
            deltas += self._finish(engine_reason)
        return merge_deltas(deltas)

    def _finish(self, engine_reason: str | None) -> list[dict]:
        """At "length" a think or response channel left open is expected and no error; inside the tools channel
        it still is one (a call may be cut, or lost in its tag)."""
        in_tools = TOOLS in self.parser.open_elements
        evs = self.parser.finish()
        if engine_reason == "length" and not in_tools:
            evs = [e for e in evs if e.kind != "error"]
        deltas = self.reply.events(evs)
        if self.parser.content is not None:
            self.reply.opened_response()
        return deltas + self.reply.finish()

    def message(self) -> dict:
        return self.reply.message()

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.reply.finish_reason(engine_reason)
