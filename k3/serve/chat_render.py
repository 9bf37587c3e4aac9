"""Rendering a chat request into XTML segments, text and token ids (the format: k3.serve.chat's docstring).

The renderer's unit is the `Segment`: a marker (one of the template's four, `special=True`) or a run of text. The
segments keep apart what the template wrote (markers) and what a message said (text), which the text alone cannot:
a message may contain the string "[open]". `encode_segments` turns markers into the tokenizer's special ids and
encodes text runs on their own, with special-token matching off, so such a message stays ordinary bytes.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from k3.serve.chat_template import (ARG, CALL, DEFAULT_CHAT_TEMPLATE, JSON_BLOCK, OPTION_ROLE, RESPONSE, ROLES,
                                    THINK, TOOLS, ChatTemplate)


class Segment(NamedTuple):
    """One piece of a rendering. `special`: a marker (a special token where the tokenizer has it). `train`: part
    of what a model writes for an assistant message (SFT trains on it). `message`: the index of the input message
    it renders, -1 for option messages and the generation prompt."""

    text: str
    special: bool
    train: bool = False
    message: int = -1


def compact_json(value) -> str:
    """Compact JSON, as typed arguments, tool declarations and fallback blocks are written."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str):
    """json.loads without Python's NaN/Infinity extensions (they have no compact JSON spelling)."""
    return json.loads(text, parse_constant=_no_constant)


def attr_value_ok(v, template: ChatTemplate, empty: bool = False) -> bool:
    """Whether `v` can be an attribute value: a string without double quotes or markers (non-empty unless
    `empty`)."""
    return isinstance(v, str) and (empty or v != "") and '"' not in v and not any(m in v for m in template.markers)


def _name_ok(v, template: ChatTemplate) -> bool:
    return attr_value_ok(v, template) and not any(c.isspace() for c in v)


def message_text(content, index: int) -> str:
    """A message's content as text: a string, or a list of {"type": "text", "text": ...} parts (concatenated)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if not isinstance(part, dict):
                raise ValueError(f"{where} must be an object like {{\"type\": \"text\", \"text\": ...}}, "
                                 f"got {type(part).__name__}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"{where}.type {kind!r} is not supported (only 'text' parts are, and 'image_url' "
                                 "parts for a model with a vision encoder)")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.text must be a string, got {type(text).__name__}")
            out.append(text)
        return "".join(out)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


class _Out:
    """Collects segments; `train` and `message` apply to what is added next."""

    def __init__(self, t: ChatTemplate):
        self.t, self.segs, self.train, self.message = t, [], False, -1

    def mark(self, m: str) -> None:
        self.segs.append(Segment(m, True, self.train, self.message))

    def text(self, s: str) -> None:
        if s:
            self.segs.append(Segment(s, False, self.train, self.message))

    def open(self, tag: str, attrs: tuple = ()) -> None:
        self.mark(self.t.open)
        self.text(tag + "".join(f' {k}="{v}"' for k, v in attrs))
        self.mark(self.t.sep)

    def close(self, tag: str) -> None:
        self.mark(self.t.close)
        self.text(tag)
        self.mark(self.t.sep)

    def element(self, tag: str, body: str, attrs: tuple = ()) -> None:
        self.open(tag, attrs)
        self.text(body)
        self.close(tag)

    def message_(self, tag: str, body: str, attrs: tuple = ()) -> None:
        self.open(tag, attrs)
        self.text(body)
        self.mark(self.t.end_of_message)
        self.close(tag)


# ----------------------------------------------------------------------------------------------- checking inputs

def check_tools(tools, where: str, t: ChatTemplate) -> list:
    """The tool declarations (OpenAI's [{"type": "function", "function": {"name": ..., ...}}]), checked."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where} must be a non-empty list of tool declarations, got {_short(tools)}")
    for j, tool in enumerate(tools):
        w = f"{where}[{j}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ValueError(f"{w} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., ...}}}}, got "
                             f"{_short(tool)}")
        name = tool["function"].get("name")
        if not _name_ok(name, t):
            raise ValueError(f"{w}.function.name = {_short(name)} is invalid: a non-empty name without whitespace, "
                             "quotes or markup")
        try:
            compact_json(tool)
        except ValueError as e:
            raise ValueError(f"{w} is not JSON-serializable: {e}") from None
    return tools


def tool_names(tools) -> list[str]:
    return [tool["function"]["name"] for tool in tools or []]


def _short(v, limit: int = 60) -> str:
    try:
        r = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    except (TypeError, ValueError):
        r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def call_arguments(args, where: str):
    """A call's arguments as a JSON value: a JSON text (OpenAI's `function.arguments`) or an already parsed
    object."""
    if isinstance(args, str):
        try:
            return loads_json(args)
        except ValueError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if isinstance(args, dict):
        try:
            compact_json(args)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where} is not JSON-serializable: {e}") from None
        return args
    raise ValueError(f"{where} must be a JSON string (or an object), got {type(args).__name__}")


def _check_calls(calls, i: int, t: ChatTemplate) -> list[tuple[str | None, str, object]]:
    """[(id, name, arguments value)] of an assistant message's tool_calls."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls, got {_short(calls)}")
    out, ids = [], set()
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise ValueError(f"{w} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": "
                             f"...}}}}, got {_short(c)}")
        if c.get("type", "function") != "function":
            raise ValueError(f"{w}.type = {_short(c.get('type'))} is not supported (only 'function')")
        cid = c.get("id")
        if cid is not None and (not isinstance(cid, str) or cid in ids):
            raise ValueError(f"{w}.id = {_short(cid)} must be a string unique within the message")
        ids.add(cid)
        name = c["function"].get("name")
        if not _name_ok(name, t):
            raise ValueError(f"{w}.function.name = {_short(name)} is invalid: a non-empty name without whitespace, "
                             "quotes or markup")
        out.append((cid, name, call_arguments(c["function"].get("arguments", "{}"), f"{w}.function.arguments")))
    return out


def _reasoning(m: dict, i: int) -> str | None:
    r = m.get("reasoning_content", m.get("reasoning"))
    if "reasoning_content" in m and "reasoning" in m and m["reasoning"] != m["reasoning_content"]:
        raise ValueError(f"messages[{i}] has both 'reasoning_content' and 'reasoning', and they differ: give one")
    if r is not None and not isinstance(r, str):
        raise ValueError(f"messages[{i}].reasoning_content must be a string or null, got {type(r).__name__}")
    return r


def check_options(t: ChatTemplate, tools, tool_choice, response_format, reasoning_effort):
    """Validates the request options; returns the tool declarations (or None)."""
    if tools is not None:
        tools = check_tools(tools, "tools", t)
    if reasoning_effort is not None and reasoning_effort not in t.effort_instructions:
        raise ValueError(f"reasoning_effort = {_short(reasoning_effort)} is invalid: one of "
                         f"{list(t.effort_instructions)} (this template's levels) or null")
    if tool_choice is not None and tool_choice not in ("auto", "none", "required"):
        ok = isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict) and _name_ok(tool_choice["function"].get("name"), t)
        if not ok:
            raise ValueError(f"tool_choice = {_short(tool_choice)} is invalid: 'auto', 'none', 'required' or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if tools is not None and tool_choice["function"]["name"] not in tool_names(tools):
            raise ValueError(f"tool_choice names the tool {tool_choice['function']['name']!r}, which tools does not "
                             f"declare (declared: {tool_names(tools)})")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format = {_short(response_format)} is invalid: its type is 'text', "
                             "'json_object' or 'json_schema'")
        if kind == "json_schema":
            if not isinstance(response_format.get("json_schema"), dict):
                raise ValueError("response_format.json_schema must be an object ({\"name\": ..., \"schema\": {...}})")
            try:
                compact_json(response_format["json_schema"])
            except (TypeError, ValueError) as e:
                raise ValueError(f"response_format.json_schema is not JSON-serializable: {e}") from None
    return tools


# ----------------------------------------------------------------------------------------------------- rendering

def _assistant(out: _Out, m: dict, i: int, t: ChatTemplate, thinking: bool) -> list:
    reasoning = _reasoning(m, i)
    content = m.get("content")
    content = None if content is None else message_text(content, i)
    calls = _check_calls(m["tool_calls"], i, t) if m.get("tool_calls") else []
    tag = t.role_tags["assistant"]
    out.open(tag)
    # The first channel's opening is the generation prefix (part of the prompt); what follows it is trained.
    if thinking:
        out.open(THINK)
        out.train = True
        out.text(reasoning or "")
        out.close(THINK)
    if content is not None or not thinking:
        out.open(RESPONSE)
        out.train = True
        out.text(content or "")
        out.close(RESPONSE)
    if calls:
        out.open(TOOLS)
        for k, (_, name, args) in enumerate(calls):
            out.open(CALL, (("tool", name), ("index", k)))
            if isinstance(args, dict) and all(attr_value_ok(key, t, empty=True) for key in args):
                for key, v in args.items():
                    if isinstance(v, str):
                        out.element(ARG, v, (("name", key),))
                    else:
                        out.element(ARG, compact_json(v), (("name", key), ("type", "json")))
            else:  # the pure-JSON fallback: inputs only, its loss masked
                out.train = False
                out.element(JSON_BLOCK, compact_json(args))
                out.train = True
            out.close(CALL)
        out.close(TOOLS)
    out.mark(t.end_of_message)
    out.train = False
    out.close(tag)
    return calls


def _option(out: _Out, kind: str, body: str, t: ChatTemplate) -> None:
    out.message_(t.role_tags[OPTION_ROLE], body, (("type", kind),))


def _input_option(out: _Out, m: dict, i: int, t: ChatTemplate) -> None:
    kind = m.get("type")
    if kind == "tool-declare":
        tools = check_tools(m.get("tools"), f"messages[{i}].tools", t)
        _option(out, kind, "\n".join(compact_json(tool) for tool in tools), t)
    elif kind == "thinking-effort":
        effort = m.get("effort")
        if effort not in t.effort_instructions:
            raise ValueError(f"messages[{i}].effort = {_short(effort)} is invalid: one of "
                             f"{list(t.effort_instructions)}")
        _option(out, kind, t.effort_instructions[effort], t)
    else:
        raise ValueError(f"messages[{i}].type = {_short(kind)} is invalid: an input option message is "
                         "'tool-declare' (with 'tools') or 'thinking-effort' (with 'effort')")


def render_chat_segments(messages, template: ChatTemplate | None = None, add_generation_prompt: bool = True, *,
                         tools=None, tool_choice=None, response_format=None, reasoning_effort=None,
                         thinking: bool = False, parallel_tool_calls: bool = True) -> list[Segment]:
    """The segments of a chat request (k3.serve.chat documents the format). Raises ValueError naming the field
    (messages[i]..., tools[j]..., tool_choice, response_format, reasoning_effort) on a bad input.
    `parallel_tool_calls=False` (with tools, unless tool_choice is "none") adds the template's single-call
    instruction to the tool_choice option message."""
    t = template or DEFAULT_CHAT_TEMPLATE
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must contain at least one message")
    tools = check_options(t, tools, tool_choice, response_format, reasoning_effort)
    out = _Out(t)
    if tools is not None:  # global options, before the input messages
        _option(out, "tool-declare", "\n".join(compact_json(tool) for tool in tools), t)
    if reasoning_effort is not None:
        _option(out, "thinking-effort", t.effort_instructions[reasoning_effort], t)
    calls, answered, last_calls_at = None, -1, -1
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES + (OPTION_ROLE,):
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES) + [OPTION_ROLE]}, got {role!r}")
        out.message = i
        if role == OPTION_ROLE:
            _input_option(out, m, i, t)
            continue
        if role == "assistant":
            # a reply that ran out of tokens while thinking comes back with reasoning_content and no content
            if "content" not in m and not m.get("tool_calls") and not m.get("reasoning_content"):
                raise ValueError(f"messages[{i}] has no 'content'")
            calls, answered, last_calls_at = _assistant(out, m, i, t, thinking) or None, -1, i
            continue
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        text = message_text(m["content"], i)
        attrs = ()
        if role == "tool":
            k = _result_index(m, i, calls, answered, last_calls_at)
            if k is not None:
                answered = k
                attrs = (("tool", calls[k][1]), ("index", k))
        else:
            calls = None
        out.message_(t.role_tags[role], text, attrs)
    out.message = -1
    choice = []  # one-shot options, after the input messages
    if tool_choice not in (None, "auto"):
        ins = t.tool_choice_instructions
        choice.append(ins[tool_choice] if isinstance(tool_choice, str) else
                      ins["function"].replace("{name}", tool_choice["function"]["name"]))
    if not parallel_tool_calls and tools is not None and tool_choice != "none":
        choice.append(t.single_call_instruction)
    if choice:
        _option(out, "tool_choice", " ".join(choice), t)
    if response_format is not None and response_format["type"] != "text":
        ins = t.response_format_instructions
        body = ins["json_object"] if response_format["type"] == "json_object" else \
            ins["json_schema"].replace("{schema}", compact_json(response_format["json_schema"]))
        _option(out, "response_format", body, t)
    if add_generation_prompt:
        out.open(t.role_tags["assistant"])
        out.open(THINK if thinking else RESPONSE)
    return out.segs


def _result_index(m: dict, i: int, calls, answered: int, at: int) -> int | None:
    """The index of the call a tool message answers: the call its tool_call_id names, else the next one. Results
    follow the order of the calls of the assistant message they answer (the most recent, with only tool messages
    after it); a tool message with no such call renders without tool/index attributes."""
    if not calls:
        return None
    cid = m.get("tool_call_id")
    if cid is None:
        k = answered + 1
        if k >= len(calls):
            raise ValueError(f"messages[{i}] is a tool result, but every call of messages[{at}] ({len(calls)}) "
                             "already has its result")
        return k
    ids = [c[0] for c in calls]
    if cid not in ids:
        raise ValueError(f"messages[{i}].tool_call_id = {_short(cid)} names no call of messages[{at}].tool_calls "
                         f"(their ids: {ids})")
    k = ids.index(cid)
    if k <= answered:
        raise ValueError(f"messages[{i}].tool_call_id = {cid!r} answers call {k} after call {answered}: results "
                         f"follow the order of messages[{at}].tool_calls, each once")
    return k


def render_chat(messages, template: ChatTemplate | None = None, add_generation_prompt: bool = True,
                **options) -> str:
    """The prompt text of a chat request: its segments joined (`options`: those of render_chat_segments)."""
    return "".join(s.text for s in render_chat_segments(messages, template, add_generation_prompt, **options))
