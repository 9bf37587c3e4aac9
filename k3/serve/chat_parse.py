"""The streaming parser of what the model writes after the generation prefix (k3.serve.chat documents the format).

`AssistantParser` takes the model's output in any pieces (markup-bearing text, literal text, markers, token ids)
and returns events as they become certain: reasoning and content deltas, a tool call's start, its argument deltas
(their concatenation is the call's `arguments`, a JSON text, at every point a prefix of it) and its end, errors
and the end. It never raises on the model's output: a malformed structure becomes an "error" event (also kept in
`errors`) and what was parsed stays. The events, and `result()`, do not depend on how the output was cut into
pieces. `open_elements` and `in_tag` show where in the grammar the parser stands (for constrained decoding).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from k3.serve.chat_render import compact_json, loads_json
from k3.serve.chat_template import (ARG, CALL, CHANNELS, DEFAULT_CHAT_TEMPLATE, JSON_BLOCK, RESPONSE, THINK, TOOLS,
                                    ChatTemplate)

_TAG = re.compile(r'([^\s"]+)((?: [A-Za-z_][\w-]*="[^"]*")*)')
_ATTR = re.compile(r' ([A-Za-z_][\w-]*)="([^"]*)"')
_CHILDREN = {"assistant": CHANNELS, TOOLS: (CALL,), CALL: (ARG, JSON_BLOCK)}


def parse_tag(text: str) -> tuple[str, dict] | None:
    """(name, attributes) of an element's opening text (between [open] and [sep]), or None when malformed
    (a repeated attribute is malformed too)."""
    m = _TAG.fullmatch(text)
    if m is None:
        return None
    pairs = _ATTR.findall(m.group(2))
    attrs = dict(pairs)
    return (m.group(1), attrs) if len(attrs) == len(pairs) else None


class ChatEvent(NamedTuple):
    """kind: "reasoning" / "content" (text: the delta), "tool_call_start" (index, name), "tool_call_arguments"
    (index, text: the delta of the arguments JSON), "tool_call_end" (index, name, arguments: the whole JSON),
    "error" (text: what is wrong), "end"."""

    kind: str
    text: str = ""
    index: int | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str  # a JSON text (an object, except from a fallback block holding another JSON value)

    def to_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedAssistant:
    """An assistant message: reasoning (None without a think channel), content (None without a response
    channel), tool calls in order, and the errors met (empty when the output was well formed)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_message(self, call_ids: list[str] | None = None) -> dict:
        """The OpenAI assistant message (reasoning as "reasoning_content"); calls get `call_ids` or "call_<i>"."""
        m = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            ids = call_ids or [f"call_{k}" for k in range(len(self.tool_calls))]
            m["tool_calls"] = [c.to_openai(i) for c, i in zip(self.tool_calls, ids)]
        return m


@dataclass
class _Frame:
    name: str
    kind: str  # "assistant", a channel, "call", "arg_str", "arg_json", "json", "drop" (content discarded)
    buf: list = field(default_factory=list)
    call: dict | None = None  # the call a call/arg/json frame belongs to
    arg: str | None = None


class AssistantParser:
    """Streaming parser of an assistant message's body. `prefix`: the channel the generation prefix opened
    ("think", "response", or None for a body given whole, as in a rendered history). `tokenizer` (optional): for
    `feed_ids`, a tokenizer with `decode` and, when it has the markup as special tokens, `special_token_id`."""

    def __init__(self, template: ChatTemplate | None = None, prefix: str | None = RESPONSE, tokenizer=None):
        self.t = template or DEFAULT_CHAT_TEMPLATE
        if prefix not in (None, THINK, RESPONSE):
            raise ValueError(f"prefix must be 'think', 'response' or None, got {prefix!r}")
        self.stack = [_Frame("assistant", "assistant")]
        self.tag_mode: str | None = None  # "open" / "close" while reading a tag, else None
        self.tagbuf: list[str] = []
        self.stray: list[str] = []  # text where none belongs, reported once at the next marker
        self.done, self.after_end = False, False
        self.reasoning: list[str] | None = None
        self.content: list[str] | None = None
        self.calls: list[dict] = []
        self.errors: list[str] = []
        self.last_channel = -1
        self.events: list[ChatEvent] = []
        self.held = ""  # feed(): a tail that may be the start of a marker
        self._pat = re.compile("|".join(re.escape(m) for m in sorted(self.t.markers, key=len, reverse=True)))
        self.tokenizer, self._ids, self._pending = tokenizer, None, []
        if tokenizer is not None:
            from k3.serve.chat_encode import markup_ids

            ids = markup_ids(tokenizer, self.t)
            self._ids = {v: k for k, v in ids.items()} if ids else None
        if prefix is not None:
            self._open_element(prefix)

    # ------------------------------------------------------------------------------------------------- state
    @property
    def open_elements(self) -> tuple[str, ...]:
        """The open elements, outermost first ("assistant", then e.g. "tools", "call", "arg")."""
        return tuple(f.name for f in self.stack)

    @property
    def in_tag(self) -> str | None:
        """"open" or "close" while inside an element's tag (after [open] / [close], before [sep]), else None."""
        return self.tag_mode

    # ---------------------------------------------------------------------------------------------- feeding
    def feed(self, text: str) -> list[ChatEvent]:
        """Model output as text in which the marker strings are markup (a decoded output). A tail that may be the
        start of a marker waits for the next piece."""
        self._feed(text)
        return self._take()

    def _feed(self, text: str) -> None:
        s = self.held + text
        at = 0
        for m in self._pat.finditer(s):
            self._text(s[at:m.start()])
            self._marker(m.group())
            at = m.end()
        rest = s[at:]
        longest = max(len(mk) for mk in self.t.markers) - 1
        keep = max((k for k in range(1, min(len(rest), longest) + 1) for mk in self.t.markers
                    if k < len(mk) and mk.startswith(rest[-k:])), default=0)
        self.held = rest[len(rest) - keep:] if keep else ""
        self._text(rest[:len(rest) - keep])

    def feed_text(self, text: str) -> list[ChatEvent]:
        """Literal text (never markup)."""
        self._flush_held()
        self._text(text)
        return self._take()

    def feed_marker(self, marker: str) -> list[ChatEvent]:
        """One marker token."""
        if marker not in self.t.markers:
            raise ValueError(f"{marker!r} is not one of the template's markers {list(self.t.markers)}")
        self._flush_held()
        self._marker(marker)
        return self._take()

    def feed_segments(self, segments) -> list[ChatEvent]:
        """Segments (k3.serve.chat_render.Segment): markers and literal text."""
        events = []
        for s in segments:
            events += self.feed_marker(s.text) if s.special else self.feed_text(s.text)
        return events

    def feed_ids(self, ids) -> list[ChatEvent]:
        """Generated token ids: the markup's special ids are markers, other ids text (decoded as far as it forms
        whole characters). Without special markup ids in the tokenizer, the decoded text goes to `feed`."""
        if self.tokenizer is None:
            raise ValueError("feed_ids needs the parser to be built with a tokenizer")
        for i in ids:
            if self._ids is not None and i in self._ids:
                self._decode_pending(final=True)
                self._flush_held()
                self._marker(self._ids[i])
            else:
                self._pending.append(int(i))
        self._decode_pending(final=False)
        return self._take()

    def _decode_pending(self, final: bool) -> None:
        if not self._pending:
            return
        s = self.tokenizer.decode(self._pending)
        if not final and s.endswith("\ufffd"):  # an unfinished UTF-8 character: wait for its next byte
            return
        self._pending = []
        self._feed(s) if self._ids is None else self._text(s)

    def finish(self) -> list[ChatEvent]:
        """The output ended (at [end_of_msg] or elsewhere): closes what is open (an error for each element left
        open) and ends."""
        if self.tokenizer is not None:
            self._decode_pending(final=True)
        self._flush_held()
        if not self.done:
            self._end()
        return self._take()

    def result(self) -> ParsedAssistant:
        """What was parsed so far (complete after `finish`)."""
        return ParsedAssistant(None if self.reasoning is None else "".join(self.reasoning),
                               None if self.content is None else "".join(self.content),
                               [ToolCall(c["index"], c["name"], c["arguments"]) for c in self.calls
                                if c["arguments"] is not None], list(self.errors))

    # ------------------------------------------------------------------------------------------ the machine
    def _take(self) -> list[ChatEvent]:
        ev, self.events = self.events, []
        return ev

    def _emit(self, kind: str, **kw) -> None:
        self.events.append(ChatEvent(kind, **kw))

    def _error(self, msg: str) -> None:
        self.errors.append(msg)
        self._emit("error", text=msg)

    def _flush_held(self) -> None:
        if self.held:
            s, self.held = self.held, ""
            self._text(s)

    def _text(self, s: str) -> None:
        if not s:
            return
        if self.done:
            self._after_end()
            return
        if self.tag_mode:
            self.tagbuf.append(s)
            return
        f = self.stack[-1]
        if f.kind == THINK:
            self.reasoning.append(s)
            self._emit("reasoning", text=s)
        elif f.kind == RESPONSE:
            self.content.append(s)
            self._emit("content", text=s)
        elif f.kind == "arg_str":
            f.buf.append(s)
            self._args(f.call, json.dumps(s, ensure_ascii=False)[1:-1])
        elif f.kind in ("arg_json", JSON_BLOCK):
            f.buf.append(s)
        elif f.kind != "drop":
            self.stray.append(s)

    def _after_end(self) -> None:
        if not self.after_end:
            self.after_end = True
            self._error(f"output continues after {self.t.end_of_message}; the rest is ignored")

    def _marker(self, m: str) -> None:
        if self.done:
            self._after_end()
            return
        if self.stray:
            s = "".join(self.stray)
            self.stray = []
            if s.strip():
                self._error(f"text {_clip(s)} outside any text element (inside {self.stack[-1].name}) is ignored")
        t = self.t
        if self.tag_mode and m != t.sep:
            self._error(f"the tag {_clip(''.join(self.tagbuf))} after [{self.tag_mode}] is not ended by {t.sep}")
            self.tag_mode, self.tagbuf = None, []
        if m == t.open:
            self.tag_mode, self.tagbuf = "open", []
        elif m == t.close:
            self.tag_mode, self.tagbuf = "close", []
        elif m == t.sep:
            mode, text = self.tag_mode, "".join(self.tagbuf)
            self.tag_mode, self.tagbuf = None, []
            if mode == "open":
                self._open_tag(text)
            elif mode == "close":
                self._close_tag(text)
            else:
                self._error(f"a stray {t.sep} inside {self.stack[-1].name}")
        else:  # end of message
            self._end()

    def _open_tag(self, text: str) -> None:
        parsed = parse_tag(text)
        parent = self.stack[-1]
        if parsed is None:
            self._error(f"malformed element tag {_clip(text)} inside {parent.name}; the element is ignored")
            self.stack.append(_Frame(text.split(" ", 1)[0], "drop"))
            return
        self._open_element(*parsed)

    def _open_element(self, name: str, attrs: dict | None = None) -> None:
        attrs = attrs or {}
        parent = self.stack[-1]
        if parent.kind == "drop":
            self.stack.append(_Frame(name, "drop"))
            return
        allowed = _CHILDREN.get(parent.kind, ())
        if name not in allowed:
            what = "channel" if parent.kind == "assistant" else "element"
            self._error(f"unknown {what} {name!r} inside {parent.name} (allowed: {list(allowed)}); it is ignored")
            self.stack.append(_Frame(name, "drop"))
            return
        if parent.kind == "assistant":
            self._check_attrs(name, attrs, ())
            k = CHANNELS.index(name)
            if k <= self.last_channel:
                self._error(f"channel {name!r} after channel {CHANNELS[self.last_channel]!r}: channels come once each, "
                            f"in the order {list(CHANNELS)}")
            self.last_channel = max(self.last_channel, k)
            if name == THINK and self.reasoning is None:
                self.reasoning = []
            if name == RESPONSE and self.content is None:
                self.content = []
            self.stack.append(_Frame(name, name))
        elif name == CALL:
            self._check_attrs(name, attrs, ("tool", "index"))
            self.stack.append(_Frame(name, CALL, call=self._start_call(attrs)))
        elif name == ARG:
            self._open_arg(parent.call, attrs)
        else:  # the pure-JSON fallback block
            self._check_attrs(name, attrs, ())
            call = parent.call
            if call["args"] or call["fallback"]:
                self._error(f"call {call['index']}: a {JSON_BLOCK} block must be the call's only content; ignored")
                self.stack.append(_Frame(name, "drop"))
            else:
                call["fallback"] = True
                self.stack.append(_Frame(name, JSON_BLOCK, call=call))

    def _check_attrs(self, name: str, attrs: dict, known: tuple) -> None:
        extra = sorted(set(attrs) - set(known))
        if extra:
            self._error(f"element {name!r} has unknown attributes {extra} (allowed: {list(known)}); ignored")

    def _start_call(self, attrs: dict) -> dict:
        name = attrs.get("tool", "")
        if not name:
            self._error(f"a call without a tool=\"...\" attribute (attributes: {attrs})")
        used = {c["index"] for c in self.calls}
        raw = attrs.get("index")
        index = int(raw) if raw is not None and raw.isascii() and raw.isdigit() else None
        if index is None:
            self._error(f"call {len(self.calls)} ({name!r}) has index={raw!r}: an index is a non-negative integer")
        elif index in used:
            self._error(f"call {len(self.calls)} ({name!r}) repeats index {index}: each call's index is unique")
            index = None
        if index is None:
            index = len(self.calls) if len(self.calls) not in used else max(used) + 1
        call = {"index": index, "name": name, "args": {}, "fallback": False, "parts": [], "arguments": None}
        self.calls.append(call)
        self._emit("tool_call_start", index=index, name=name)
        return call

    def _args(self, call: dict, delta: str) -> None:
        call["parts"].append(delta)
        self._emit("tool_call_arguments", index=call["index"], text=delta)

    def _open_arg(self, call: dict, attrs: dict) -> None:
        self._check_attrs(ARG, attrs, ("name", "type"))
        name, kind = attrs.get("name"), attrs.get("type")
        why = None
        if name is None:
            why = "has no name=\"...\" attribute"
        elif name in call["args"]:
            why = f"repeats the argument {name!r}"
        elif call["fallback"]:
            why = f"follows a {JSON_BLOCK} block"
        elif kind not in (None, "json"):
            why = f"has type={kind!r} (allowed: no type for a string, type=\"json\" for other JSON)"
        if why:
            self._error(f"call {call['index']}: an argument {why}; it is ignored")
            self.stack.append(_Frame(ARG, "drop"))
            return
        call["args"][name] = None
        self._args(call, ("," if len(call["args"]) > 1 else "{") + json.dumps(name, ensure_ascii=False) + ":"
                   + ('"' if kind is None else ""))
        self.stack.append(_Frame(ARG, "arg_str" if kind is None else "arg_json", call=call, arg=name))

    def _close_tag(self, text: str) -> None:
        names = [f.name for f in self.stack]
        if text in names[1:]:
            while self.stack[-1].name != text:
                self._error(f"element {self.stack[-1].name!r} is not closed before {text!r}")
                self._pop()
            self._pop()
        else:
            self._error(f"a close tag {_clip(text)} matches no open element (open: {names}); it is ignored")

    def _pop(self) -> None:
        f = self.stack.pop()
        call = f.call
        if f.kind == "arg_str":
            self._args(call, '"')
        elif f.kind in ("arg_json", JSON_BLOCK):
            raw = "".join(f.buf)
            try:
                text = compact_json(loads_json(raw))
            except ValueError as e:
                what = f"argument {f.arg!r}" if f.kind == "arg_json" else f"the {JSON_BLOCK} block"
                self._error(f"call {call['index']}: {what} is not valid JSON ({e}); kept as a string")
                text = json.dumps(raw, ensure_ascii=False)
            self._args(call, text)
        elif f.kind == CALL:
            if not call["fallback"]:
                self._args(call, "}" if call["args"] else "{}")
            call["arguments"] = "".join(call["parts"])
            self._emit("tool_call_end", index=call["index"], name=call["name"], arguments=call["arguments"])

    def _end(self) -> None:
        if self.tag_mode:
            self._error(f"the tag {_clip(''.join(self.tagbuf))} after [{self.tag_mode}] is not ended by {self.t.sep}")
            self.tag_mode, self.tagbuf = None, []
        if self.stray and "".join(self.stray).strip():
            self._error(f"text {_clip(''.join(self.stray))} outside any text element (inside {self.stack[-1].name}) "
                        "is ignored")
        self.stray = []
        while len(self.stack) > 1:
            self._error(f"element {self.stack[-1].name!r} is not closed at the end of the message")
            self._pop()
        self.done = True
        self._emit("end")


def _clip(s: str, n: int = 40) -> str:
    return repr(s if len(s) <= n else s[:n - 3] + "...")


def parse_assistant(output, template: ChatTemplate | None = None, prefix: str | None = RESPONSE) -> ParsedAssistant:
    """Parse a whole model output (text with markup, or segments) that followed the generation prefix opening
    `prefix` (None: a message body with every channel written out). Never raises on the output's content."""
    p = AssistantParser(template, prefix)
    p.feed_segments(output) if isinstance(output, list) else p.feed(output)
    p.finish()
    return p.result()
