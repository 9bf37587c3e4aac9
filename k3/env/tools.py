"""Tools (report §4.2.1, the "tool interfaces" module): what an agent can do in its sandbox.

A `Tool` declares its JSON-schema parameters once; the same declaration gives the OpenAI `tools` spec the policy
sees and validates the arguments of every call. A call never raises out of the episode: an unknown tool, arguments
that are not a JSON object, a missing, extra or mistyped argument, or a failure inside the tool become the call's
result text, starting with `ERROR_PREFIX`, and count as tool errors.

The built-in tools are in `k3.env.toolbox`; a harness exposes them under their own names or under aliases, with
their own or variant descriptions (`Tool.renamed`), so that a policy does not learn one tool schema by heart.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from k3.env.sandbox import Sandbox, SandboxError
from k3.env.task import Task, Verdict

if TYPE_CHECKING:
    from k3.env.memory import MemoryStore
    from k3.env.skills import SkillLibrary

ERROR_PREFIX = "ERROR: "
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


class ToolError(Exception):
    """An expected failure of a tool (no such file, no submissions left): its message is the result text."""


@dataclass
class ToolContext:
    """What a tool call may touch: the episode's sandbox and task, and the episode state that tools change
    (the submitted answer, whether the episode should end). Built by the episode, one per episode."""
    sandbox: Sandbox
    task: Task
    deadline: float | None = None          # time.monotonic() at which the episode's wall budget ends
    answer: str | None = None              # the last submitted answer
    submissions: int = 0
    finished: bool = False                 # a submission ended the episode
    public_verdicts: list[dict] = field(default_factory=list)
    memory: "MemoryStore | None" = None
    skills: "SkillLibrary | None" = None
    delegate: Callable[[str], str] | None = None   # runs a sub-episode on the instructions, returns its answer
    kernel_device: str = "cpu"

    def time_left(self, want: float | None = None) -> float | None:
        """Seconds a command may run: `want` (if given), but never past the episode's deadline."""
        if self.deadline is None:
            return want
        left = max(0.1, self.deadline - time.monotonic())
        return left if want is None else min(want, left)


@dataclass(frozen=True)
class Tool:
    """One tool: `fn(ctx, **arguments) -> str`, its arguments described by the JSON schema `parameters` (an object
    schema; properties not listed are refused)."""
    name: str
    description: str
    parameters: dict
    fn: Callable[..., str]

    def spec(self) -> dict:
        """The OpenAI chat-completions `tools` entry."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def renamed(self, name: str | None = None, description: str | None = None) -> "Tool":
        """The same tool under another name or description (a harness's alias or variant)."""
        return replace(self, name=name or self.name, description=description or self.description)


def params(required: dict | None = None, optional: dict | None = None) -> dict:
    """An object schema: `required` and `optional` map argument names to their property schemas."""
    required, optional = required or {}, optional or {}
    return {"type": "object", "properties": {**required, **optional}, "required": list(required),
            "additionalProperties": False}


def string(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def integer(description: str, **extra) -> dict:
    return {"type": "integer", "description": description, **extra}


def number(description: str, **extra) -> dict:
    return {"type": "number", "description": description, **extra}


# --- argument validation -------------------------------------------------------------------------------------------

def check_value(schema: dict, value, where: str) -> list[str]:
    """Every way `value` breaks `schema` (the subset of JSON schema tools use: type, enum, properties, required,
    additionalProperties, items, minimum, maximum), as messages naming the argument, the value and what is allowed."""
    errors = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        ok = any(isinstance(value, _JSON_TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        if not ok:
            return [f"{where} must be {' or '.join(types)}, got {type(value).__name__} {_short(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where} must be one of {schema['enum']}, got {_short(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where} must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where} must be <= {schema['maximum']}, got {value}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += check_value(schema["items"], item, f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"missing required argument '{name}'" if where == "arguments"
                              else f"{where} is missing '{name}'")
        if schema.get("additionalProperties", True) is False:
            for name in value:
                if name not in props:
                    errors.append(f"unexpected argument '{name}' (allowed: {sorted(props)})")
        for name, sub in props.items():
            if name in value:
                errors += check_value(sub, value[name], f"argument '{name}'" if where == "arguments"
                                      else f"{where}.{name}")
    return errors


def parse_arguments(tool: Tool, arguments: str | dict | None) -> tuple[dict | None, str | None]:
    """The call's arguments as a dict, or None and the reason they are refused."""
    if arguments is None or arguments == "":
        args = {}
    elif isinstance(arguments, dict):
        args = arguments
    else:
        try:
            args = json.loads(arguments)
        except (TypeError, ValueError) as e:
            return None, f"arguments of '{tool.name}' are not valid JSON ({e}): {_short(arguments)}"
    if not isinstance(args, dict):
        return None, f"arguments of '{tool.name}' must be a JSON object, got {type(args).__name__} {_short(args)}"
    errors = check_value(tool.parameters, args, "arguments")
    if errors:
        return None, f"invalid arguments for '{tool.name}': " + "; ".join(errors)
    return args, None


# --- calling -----------------------------------------------------------------------------------------------------

@dataclass
class ToolOutcome:
    """One call's result text (already truncated) and whether it was an error."""
    text: str
    error: bool
    wall_s: float = 0.0


def call_tool(tools: dict[str, Tool], ctx: ToolContext, name: str, arguments: str | dict | None,
              max_output_chars: int) -> ToolOutcome:
    """Run one call by its exposed name. Never raises: every failure is an error outcome."""
    t0 = time.perf_counter()
    tool = tools.get(name)
    if tool is None:
        text, error = f"{ERROR_PREFIX}unknown tool {name!r}; available tools: {sorted(tools)}", True
    else:
        args, problem = parse_arguments(tool, arguments)
        if problem is not None:
            text, error = ERROR_PREFIX + problem, True
        else:
            try:
                text, error = tool.fn(ctx, **args), False
                if not isinstance(text, str):
                    raise TypeError(f"tool {tool.name!r} returned {type(text).__name__}, not str")
            except (ToolError, SandboxError) as e:
                text, error = f"{ERROR_PREFIX}{e}", True
            except Exception as e:  # a bug in a tool must not end the episode: the agent sees it, the log keeps it
                text, error = f"{ERROR_PREFIX}tool {tool.name!r} failed: {type(e).__name__}: {e}", True
    return ToolOutcome(truncate(text, max_output_chars), error, time.perf_counter() - t0)


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to about `max_chars`: its head and tail kept, with a note of how much was cut between them."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut: the output exceeded {max_chars} characters ...]\n" \
           f"{text[len(text) - tail:] if tail else ''}"


def verdict_text(verdict: Verdict) -> str:
    lines = [f"success: {verdict.success}", f"reward: {verdict.reward:.4g}"]
    if verdict.details:
        lines.append(verdict.details)
    return "\n".join(lines)


def _short(value, n: int = 80) -> str:
    s = repr(value)
    return s if len(s) <= n else s[:n] + "..."
