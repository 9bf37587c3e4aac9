"""The parse of a whole rendered conversation back into the chat request it came from (k3.serve.chat documents
the format): the inverse of render_chat_segments, strict where the streaming parser is lenient."""

from __future__ import annotations

from k3.serve.chat_encode import split_markup
from k3.serve.chat_parse import AssistantParser, _clip, parse_tag
from k3.serve.chat_render import loads_json
from k3.serve.chat_template import DEFAULT_CHAT_TEMPLATE, OPTION_ROLE, RESPONSE, THINK, ChatTemplate


def parse_conversation(rendered, template: ChatTemplate | None = None) -> dict:
    """The chat request a rendering came from: {"messages", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "reasoning_effort", "thinking", "add_generation_prompt"}, such that rendering it again gives `rendered`.
    Calls get ids "call_<message>_<index>", which tool results name. `rendered` is segments (exact) or text
    (exact when no message text holds a marker string). Raises ValueError on anything the renderer would not
    write. "auto" tool_choice and a "text" response_format render nothing and come back as None."""
    t = template or DEFAULT_CHAT_TEMPLATE
    segs = split_markup(rendered, t) if isinstance(rendered, str) else list(rendered)
    tags = {v: k for k, v in t.role_tags.items()}
    out = {"messages": [], "tools": None, "tool_choice": None, "parallel_tool_calls": True, "response_format": None,
           "reasoning_effort": None, "thinking": None, "add_generation_prompt": False}
    msgs, calls, oneshot, pos = out["messages"], None, [], 0

    def mark(m):
        nonlocal pos
        if pos >= len(segs) or not segs[pos].special or segs[pos].text != m:
            got = "the end" if pos >= len(segs) else repr(segs[pos].text)
            raise ValueError(f"segment {pos}: expected {m!r}, got {got}")
        pos += 1

    def text():
        nonlocal pos
        s = []
        while pos < len(segs) and not segs[pos].special:
            s.append(segs[pos].text)
            pos += 1
        return "".join(s)

    while pos < len(segs):
        mark(t.open)
        head = text()
        mark(t.sep)
        parsed = parse_tag(head)
        if parsed is None or parsed[0] not in tags:
            raise ValueError(f"segment {pos}: {head!r} opens no message (tags: {sorted(tags)})")
        role, attrs = tags[parsed[0]], parsed[1]
        if role == "assistant":
            start = pos
            while pos < len(segs) and not (segs[pos].special and segs[pos].text == t.end_of_message):
                pos += 1
            body = segs[start:pos]
            if pos >= len(segs):  # the generation prompt: the assistant's opening and the generation prefix
                if len(body) != 3 or body[1].text not in (THINK, RESPONSE):
                    raise ValueError(f"segment {start}: an assistant message without {t.end_of_message!r}")
                out["thinking"], out["add_generation_prompt"] = body[1].text == THINK, True
                break
            p = AssistantParser(t, None)
            p.feed_segments(body)
            p.finish()
            r = p.result()
            if r.errors:
                raise ValueError(f"messages[{len(msgs)}] (assistant): {r.errors[0]}")
            k = len(msgs)
            m = r.to_message([f"call_{k}_{c.index}" for c in r.tool_calls])
            out["thinking"] = r.reasoning is not None if out["thinking"] is None else out["thinking"]
            msgs.append(m)
            calls = {str(c.index): (f"call_{k}_{c.index}", c.name) for c in r.tool_calls}
            mark(t.end_of_message)
        else:
            body = text()
            mark(t.end_of_message)
            if role == OPTION_ROLE:
                _option(out, attrs.get("type"), body, t, oneshot)
            else:
                if oneshot:
                    raise ValueError(f"messages[{len(msgs)}] follows a one-shot option message")
                m = {"role": role, "content": body}
                if role == "tool" and attrs:
                    call = (calls or {}).get(attrs.get("index"))
                    if call is None or call[1] != attrs.get("tool"):
                        raise ValueError(f"messages[{len(msgs)}]: a tool result for {attrs} answers no call")
                    m["tool_call_id"] = call[0]
                elif role != "tool":
                    calls = None
                msgs.append(m)
        mark(t.close)
        if text() != parsed[0]:
            raise ValueError(f"segment {pos}: message {parsed[0]!r} is not closed by its own tag")
        mark(t.sep)
    return out


def _option(out: dict, kind, body: str, t: ChatTemplate, oneshot: list) -> None:
    msgs = out["messages"]
    if kind in ("tool_choice", "response_format"):
        oneshot.append(kind)
        if kind == "tool_choice":
            ins = t.tool_choice_instructions
            single = t.single_call_instruction
            if body == single or body.endswith(" " + single):
                out["parallel_tool_calls"] = False
                body = body[:-len(single)].removesuffix(" ")
                if not body:
                    return
            rev = {v: k for k, v in ins.items() if k not in ("function", "single")}
            head, _, tail = ins["function"].partition("{name}")
            if body in rev:
                out["tool_choice"] = rev[body]
            elif body.startswith(head) and body.endswith(tail) and len(body) > len(head) + len(tail):
                out["tool_choice"] = {"type": "function", "function": {"name": body[len(head):len(body) - len(tail)]}}
            else:
                raise ValueError(f"a tool_choice option message says {_clip(body)}, no instruction of this template")
        else:
            ins = t.response_format_instructions
            head, _, tail = ins["json_schema"].partition("{schema}")
            if body == ins["json_object"]:
                out["response_format"] = {"type": "json_object"}
            elif body.startswith(head) and body.endswith(tail):
                out["response_format"] = {"type": "json_schema",
                                          "json_schema": loads_json(body[len(head):len(body) - len(tail)])}
            else:
                raise ValueError(f"a response_format option message says {_clip(body)}, no instruction of this "
                                 "template")
        return
    if oneshot:
        raise ValueError(f"a {kind!r} option message follows a one-shot option message")
    if kind == "tool-declare":
        value = [loads_json(line) for line in body.split("\n")]
        key = "tools"
    elif kind == "thinking-effort":
        rev = {v: k for k, v in t.effort_instructions.items()}
        if body not in rev:
            raise ValueError(f"a thinking-effort option message says {_clip(body)}, no level of this template")
        value, key = rev[body], "effort"
    else:
        raise ValueError(f"an option message of type {kind!r} (types: tool-declare, thinking-effort, tool_choice, "
                         "response_format)")
    # Before the first input message: the global options (tools, then effort), while their slots are free; an
    # input option message there renders the same, so the parse takes it for the global.
    if not msgs and kind == "tool-declare" and out["tools"] is None and out["reasoning_effort"] is None:
        out["tools"] = value
    elif not msgs and kind == "thinking-effort" and out["reasoning_effort"] is None:
        out["reasoning_effort"] = value
    else:  # an input option message
        msgs.append({"role": OPTION_ROLE, "type": kind, key: value})
