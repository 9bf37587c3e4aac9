"""The chat template: how a conversation becomes the prompt text (report appendix F).

K3 marks up a conversation XTML-style. Every message is

    [open]<tag>[sep]<content>[end_of_msg][close]<tag>[sep]

where <tag> names the speaker (system, user, response for the assistant, tool), and the prompt ends with the
generation prefix `[open]response[sep]` (instruct mode), after which the model writes the assistant message and
ends it with `[end_of_msg]`. Our byte-level tokenizer has no special tokens for the markup: the markers are plain
strings, and the end of the assistant message is detected with stop strings (`ChatTemplate.stop`), which the server
adds to every chat request's stop list.

The template is data, stored with the checkpoint as `chat_template.json` (`save_chat_template`); a checkpoint
without the file uses `DEFAULT_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from k3.files import atomic_write_text

CHAT_TEMPLATE_FILE = "chat_template.json"
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTemplate:
    open: str = "[open]"
    sep: str = "[sep]"
    close: str = "[close]"
    end_of_message: str = "[end_of_msg]"
    # The markup tag of each role; the assistant speaks in `response` blocks.
    role_tags: dict = field(default_factory=lambda: {"system": "system", "user": "user", "assistant": "response",
                                                     "tool": "tool"})
    generation_prefix: str = "[open]response[sep]"
    # Generation ends at the first of these (the end of the assistant message).
    stop: tuple = ("[end_of_msg]", "[close]response[sep]")
    format_version: int = 1

    def validate(self) -> None:
        for name in ("open", "sep", "close", "end_of_message", "generation_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"chat template field '{name}' must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.role_tags, dict) or set(self.role_tags) != set(ROLES):
            raise ValueError(f"chat template field 'role_tags' must map exactly the roles {list(ROLES)} to tags, "
                             f"got {self.role_tags!r}")
        if not all(isinstance(t, str) and t for t in self.role_tags.values()):
            raise ValueError("chat template role tags must be non-empty strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"chat template stop strings must be non-empty strings, got {list(self.stop)!r}")
        if self.format_version != 1:
            raise ValueError(f"unsupported chat template format_version {self.format_version!r} (this k3 reads 1)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ChatTemplate":
        if not isinstance(d, dict):
            raise ValueError(f"a chat template is a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown chat template fields: {unknown} (known: {sorted(known)})")
        d = dict(d)
        if "stop" in d:
            if not isinstance(d["stop"], list):
                raise ValueError(f"chat template field 'stop' must be a list of strings, got {d['stop']!r}")
            d["stop"] = tuple(d["stop"])
        t = cls(**d)
        t.validate()
        return t


DEFAULT_CHAT_TEMPLATE = ChatTemplate()


def save_chat_template(directory: str | os.PathLike, template: ChatTemplate | None = None) -> str:
    """Write `directory/chat_template.json` (atomically); returns its path."""
    template = template or DEFAULT_CHAT_TEMPLATE
    template.validate()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CHAT_TEMPLATE_FILE)
    atomic_write_text(path, chat_template_json(template))
    return path


def chat_template_json(template: ChatTemplate) -> str:
    """The text of `chat_template.json` for `template` (what `save_chat_template` writes)."""
    template.validate()
    return json.dumps(template.to_dict(), indent=2, ensure_ascii=False) + "\n"


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate:
    """The checkpoint's chat template, or the default when it has no chat_template.json."""
    path = os.path.join(os.fspath(directory), CHAT_TEMPLATE_FILE)
    if not os.path.isfile(path):
        return DEFAULT_CHAT_TEMPLATE
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    try:
        return ChatTemplate.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


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
                raise ValueError(f"{where}.type {kind!r} is not supported (only 'text' parts are)")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.text must be a string, got {type(text).__name__}")
            out.append(text)
        return "".join(out)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


def render_chat(messages, template: ChatTemplate | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation. `messages` is a non-empty list of {"role": ..., "content": ...} with
    roles system / user / assistant / tool; an assistant message may have null content. Raises ValueError, naming
    the offending message, on anything else."""
    t = template or DEFAULT_CHAT_TEMPLATE
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must contain at least one message")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        content = m["content"]
        if content is None and role == "assistant":
            content = ""
        text = message_text(content, i)
        tag = t.role_tags[role]
        parts.append(f"{t.open}{tag}{t.sep}{text}{t.end_of_message}{t.close}{tag}{t.sep}")
    if add_generation_prompt:
        parts.append(t.generation_prefix)
    return "".join(parts)


def stop_strings(template: ChatTemplate | None = None) -> list[str]:
    """The strings that end an assistant message, for the request's stop list."""
    return list((template or DEFAULT_CHAT_TEMPLATE).stop)
