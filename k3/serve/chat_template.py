"""The chat template as data: its markers, tags and option instructions, stored with a checkpoint as
`chat_template.json`, and the upgrade of format_version 1 files (k3.serve.chat documents the format itself).

A format_version 1 file (the template before channels and tool calls) loads as version 2 when its fields map onto
version 2: the four markers and the system/user/tool tags carry over; its assistant tag ("response", the block the
assistant spoke in) is the version 2 response channel, and its generation prefix and stop strings must be the ones
those markers imply. A version 1 file that customised these cannot be mapped, and loading it fails with the two
ways out: `k3 chat-template migrate CK` (rewrites the file as version 2, keeping what maps and naming what it
drops) or deleting the file (the checkpoint then uses `DEFAULT_CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from k3.files import atomic_write_text

CHAT_TEMPLATE_FILE = "chat_template.json"
FORMAT_VERSION = 2
ROLES = ("system", "user", "assistant", "tool")  # the roles of input messages (OpenAI's)
OPTION_ROLE = "option"  # input option messages: {"role": "option", "type": "tool-declare", "tools": [...]}
EFFORT_LEVELS = ("low", "medium", "high", "max")  # the levels the format reserves (report appendix F)
# Element names inside an assistant message (fixed by the format, not template data): its channels in their order,
# a tool call, a typed argument, the pure-JSON fallback block of a call's arguments.
THINK, RESPONSE, TOOLS = "think", "response", "tools"
CHANNELS = (THINK, RESPONSE, TOOLS)
CALL, ARG, JSON_BLOCK = "call", "arg", "json"
OPTION_TYPES = ("tool-declare", "thinking-effort", "tool_choice", "response_format")


def _default_role_tags() -> dict:
    return {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool", "option": "option"}


def _default_effort() -> dict:
    return {
        "low": "Reasoning effort: low. Think briefly, only as much as the task needs, then answer.",
        "medium": "Reasoning effort: medium. Think the task through at moderate length before answering.",
        "high": "Reasoning effort: high. Think carefully and thoroughly, checking your work, before answering.",
        "max": "Reasoning effort: max. Think as long and as deeply as the task rewards; explore alternatives and "
               "verify every step before answering.",
    }


def _default_tool_choice() -> dict:
    return {
        "none": "Do not call any tool in your next message; answer directly.",
        "required": "Your next message must call at least one tool.",
        "function": "Your next message must call the tool {name}.",
        "single": "Call at most one tool in your next message.",
    }


def _default_response_format() -> dict:
    return {
        "json_object": "Your response must be one valid JSON object and nothing else.",
        "json_schema": "Your response must be one valid JSON value that matches this JSON schema, and nothing else:\n"
                       "{schema}",
    }


class ChatTemplateError(ValueError):
    """A chat template (a file or fields) is invalid or cannot be upgraded; the message names the field and the fix."""


@dataclass(frozen=True)
class ChatTemplate:
    """Markers, message tags and the natural-language instructions of option messages (k3.serve.chat).

    `effort_instructions` maps the supported reasoning-effort levels (a subset of EFFORT_LEVELS) to their
    instruction; `tool_choice_instructions` has "none", "required" and "function" (with a "{name}" slot), and
    may have "single" (parallel_tool_calls=false; a file without it gets the default's);
    `response_format_instructions` has "json_object" and "json_schema" (with a "{schema}" slot)."""

    open: str = "[open]"
    sep: str = "[sep]"
    close: str = "[close]"
    end_of_message: str = "[end_of_msg]"
    role_tags: dict = field(default_factory=_default_role_tags)
    effort_instructions: dict = field(default_factory=_default_effort)
    tool_choice_instructions: dict = field(default_factory=_default_tool_choice)
    response_format_instructions: dict = field(default_factory=_default_response_format)
    format_version: int = FORMAT_VERSION

    # ------------------------------------------------------------------------------------------- derived
    @property
    def markers(self) -> tuple[str, str, str, str]:
        return (self.open, self.sep, self.close, self.end_of_message)

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings for a plain instruct-mode reply: the end of the message, or the close of the response
        channel (a reply without tool calls is complete there). Servers whose tokenizer has the markup as special
        tokens stop on the end-of-message id instead (k3.serve.chat.chat_stop)."""
        return (self.end_of_message, f"{self.close}response{self.sep}")

    @property
    def single_call_instruction(self) -> str:
        """The one-shot instruction of parallel_tool_calls=false (a template file may leave it out)."""
        return self.tool_choice_instructions.get("single") or _default_tool_choice()["single"]

    def generation_prefix(self, thinking: bool) -> str:
        """The channel the model is asked to write first: think (thinking mode) or response (instruct mode)."""
        return f"{self.open}{'think' if thinking else 'response'}{self.sep}"

    # ---------------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        for name in ("open", "sep", "close", "end_of_message"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ChatTemplateError(f"chat template field '{name}' must be a non-empty string, got {v!r}")
        if len(set(self.markers)) != 4:
            raise ChatTemplateError(f"chat template markers must be four distinct strings, got {list(self.markers)}")
        want = set(ROLES) | {OPTION_ROLE}
        if not isinstance(self.role_tags, dict) or set(self.role_tags) != want:
            raise ChatTemplateError(f"chat template field 'role_tags' must map exactly {sorted(want)} to tags, got "
                                    f"{self.role_tags!r}")
        for role, tag in self.role_tags.items():
            if not isinstance(tag, str) or not tag or any(c.isspace() or c == '"' for c in tag) or \
                    any(m in tag for m in self.markers):
                raise ChatTemplateError(f"chat template field 'role_tags.{role}' = {tag!r} is invalid: a tag is a "
                                        "non-empty string without whitespace, quotes or markers")
        self._check_texts("effort_instructions", self.effort_instructions, set(EFFORT_LEVELS), None, subset=True)
        self._check_texts("tool_choice_instructions", self.tool_choice_instructions, {"none", "required", "function"},
                          ("function", "{name}"), optional={"single"})
        self._check_texts("response_format_instructions", self.response_format_instructions,
                          {"json_object", "json_schema"}, ("json_schema", "{schema}"))
        if self.format_version != FORMAT_VERSION:
            raise ChatTemplateError(f"chat template field 'format_version' = {self.format_version!r} is not supported "
                                    f"(this k3 writes {FORMAT_VERSION} and reads 1 and {FORMAT_VERSION})")

    def _check_texts(self, name, d, keys, slot, subset=False, optional=frozenset()) -> None:
        if not isinstance(d, dict) or (not d if subset else not keys <= set(d)) or not set(d) <= keys | optional:
            also = f" (and optionally {sorted(optional)})" if optional else ""
            raise ChatTemplateError(f"chat template field '{name}' must map {'some of ' if subset else ''}"
                                    f"{sorted(keys)}{also} to instructions, got {d!r}")
        for k, v in d.items():
            if not isinstance(v, str) or not v or any(m in v for m in self.markers):
                raise ChatTemplateError(f"chat template field '{name}.{k}' must be a non-empty string without "
                                        f"markers, got {v!r}")
        if slot and d[slot[0]].count(slot[1]) != 1:
            raise ChatTemplateError(f"chat template field '{name}.{slot[0]}' must hold {slot[1]} exactly once, got "
                                    f"{d[slot[0]]!r}")

    # --------------------------------------------------------------------------------------- (de)serialize
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, checkpoint: str = "CK") -> "ChatTemplate":
        """A template from its JSON object; a format_version 1 object is upgraded (the module docstring).
        `checkpoint` names the directory in the migration advice."""
        if not isinstance(d, dict):
            raise ChatTemplateError(f"a chat template is a JSON object, got {type(d).__name__}")
        if d.get("format_version", 1) == 1:
            t, dropped = upgrade_v1(d)
            if dropped:
                field_name, why = dropped[0]
                raise ChatTemplateError(
                    f"format_version 1 field '{field_name}' cannot be mapped onto format_version {FORMAT_VERSION} "
                    f"({why}); run `k3 chat-template migrate {checkpoint}` to rewrite the file as format_version "
                    f"{FORMAT_VERSION} (it keeps the fields that map and drops this one), or delete "
                    f"{os.path.join(checkpoint, CHAT_TEMPLATE_FILE)} to use the default template")
            return t
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ChatTemplateError(f"unknown chat template fields: {unknown} (known: {sorted(known)})")
        t = cls(**d)
        t.validate()
        return t


V1_FIELDS = ("open", "sep", "close", "end_of_message", "role_tags", "generation_prefix", "stop", "format_version")


def upgrade_v1(d: dict) -> tuple[ChatTemplate, list[tuple[str, str]]]:
    """(the version 2 template a format_version 1 object maps onto, [(field, why it was dropped)]). The template
    keeps every field that maps; a non-empty list means the upgrade changes what the file asked for."""
    unknown = sorted(set(d) - set(V1_FIELDS))
    if unknown:
        raise ChatTemplateError(f"unknown chat template fields: {unknown} (format_version 1 knows {list(V1_FIELDS)})")
    dropped: list[tuple[str, str]] = []
    kw = {k: d[k] for k in ("open", "sep", "close", "end_of_message") if k in d}
    base = ChatTemplate(**kw)
    try:
        base.validate()
    except ChatTemplateError:
        for k in list(kw):  # a marker that is itself invalid is dropped; the rest are kept
            try:
                ChatTemplate(**{k: kw[k]}).validate()
            except ChatTemplateError as e:
                dropped.append((k, str(e)))
                del kw[k]
        base = ChatTemplate(**kw)
        base.validate()
    tags = _default_role_tags()
    v1_tags = d.get("role_tags", {"system": "system", "user": "user", "assistant": "response", "tool": "tool"})
    if not isinstance(v1_tags, dict) or set(v1_tags) != set(ROLES):
        dropped.append(("role_tags", f"it must map exactly {list(ROLES)} to tags, got {v1_tags!r}"))
        v1_tags = {}
    for role in ("system", "user", "tool"):
        if role in v1_tags:
            tags[role] = v1_tags[role]
    if v1_tags.get("assistant", "response") != "response":
        dropped.append(("role_tags", f"the assistant tag {v1_tags['assistant']!r} named the block the assistant "
                                     "spoke in, which format_version 2 calls the response channel (a fixed name)"))
    try:
        t = ChatTemplate(**kw, role_tags=tags)
        t.validate()
    except ChatTemplateError as e:
        dropped.append(("role_tags", str(e)))
        t = base
    prefix = d.get("generation_prefix", t.generation_prefix(False))
    if prefix != t.generation_prefix(False):
        dropped.append(("generation_prefix", f"{prefix!r} is not {t.generation_prefix(False)!r}, the instruct-mode "
                                             "prefix of these markers (format_version 2 derives it)"))
    stop = d.get("stop", list(t.stop))
    if not isinstance(stop, list) or t.end_of_message not in stop or not set(stop) <= set(t.stop):
        dropped.append(("stop", f"{stop!r} is not a list of {list(t.stop)} holding {t.end_of_message!r} "
                                "(format_version 2 derives its stop strings from the markers)"))
    return t, dropped


DEFAULT_CHAT_TEMPLATE = ChatTemplate()


def chat_template_json(template: ChatTemplate) -> str:
    """The text of `chat_template.json` for `template` (what `save_chat_template` writes)."""
    template.validate()
    return json.dumps(template.to_dict(), indent=2, ensure_ascii=False) + "\n"


def save_chat_template(directory: str | os.PathLike, template: ChatTemplate | None = None) -> str:
    """Write `directory/chat_template.json` (atomically); returns its path."""
    template = template or DEFAULT_CHAT_TEMPLATE
    directory = os.fspath(directory)
    text = chat_template_json(template)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CHAT_TEMPLATE_FILE)
    atomic_write_text(path, text)
    return path


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from None


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate:
    """The checkpoint's chat template, or the default when it has no chat_template.json. A format_version 1 file
    is upgraded when it maps onto version 2, and otherwise raises ChatTemplateError saying how to migrate it."""
    path = os.path.join(os.fspath(directory), CHAT_TEMPLATE_FILE)
    if not os.path.isfile(path):
        return DEFAULT_CHAT_TEMPLATE
    try:
        return ChatTemplate.from_dict(_read(path), checkpoint=os.fspath(directory))
    except (TypeError, ValueError) as e:
        raise ChatTemplateError(e if str(e).startswith(path) else f"{path}: {e}") from None


def migrate_chat_template(directory: str | os.PathLike) -> tuple[str, list[str]]:
    """Rewrite `directory/chat_template.json` as format_version 2 (`k3 chat-template migrate`); returns (its path,
    notes on what changed: the fields dropped and why). A version 2 file is left as it is."""
    path = os.path.join(os.fspath(directory), CHAT_TEMPLATE_FILE)
    if not os.path.isfile(path):
        raise ChatTemplateError(f"{path} does not exist: the checkpoint uses the default template, nothing to migrate")
    d = _read(path)
    if not isinstance(d, dict):
        raise ChatTemplateError(f"{path}: a chat template is a JSON object, got {type(d).__name__}")
    if d.get("format_version", 1) != 1:
        ChatTemplate.from_dict(d)  # raises if it is not a valid version 2 file
        return path, [f"{path} is already format_version {d['format_version']}"]
    t, dropped = upgrade_v1(d)
    save_chat_template(directory, t)
    return path, [f"dropped '{k}': {why}" for k, why in dropped] or ["every field mapped onto format_version 2"]
