"""The agent harness (report §4.2.1): a composition of configurable modules, given as plain data.

A `HarnessConfig` names the tools (each under its own name or an alias, with its own or a variant description),
the system-prompt template, the context strategy, and the optional modules: memory (notes kept across the
episodes of a task family), skills (instruction files loaded on demand) and subagents (a `delegate` tool running a
sub-episode). Different compositions reproduce common harnesses and new ones (`k3.env.presets`); RL draws a
different one per task group (`presets.HarnessSampler`) so the policy does not overfit one tool schema or prompt.

The template is `str.format`-style with the fields in `PROMPT_FIELDS`; the task's prompt is the first user
message, not part of the system prompt.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from dataclasses import dataclass, field

from k3.env.memory import MemoryStore
from k3.env.sandbox import WORKSPACE
from k3.env.skills import SkillLibrary
from k3.env.task import Task
from k3.env.toolbox import BUILTIN_TOOLS
from k3.env.tools import Tool

CONTEXT_STRATEGIES = ("keep_all", "drop_old_tool_outputs", "summarize")
PROMPT_FIELDS = ("tools", "workspace", "skills", "memory", "submit")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")    # what OpenAI-style tool specs allow


class HarnessConfigError(ValueError):
    """A harness configuration names an unknown field, or a field holds a value it does not allow."""


@dataclass(frozen=True)
class ToolChoice:
    """A built-in tool as the harness exposes it: `name` (an alias) and `description` (a variant) default to the
    tool's own."""
    tool: str
    name: str | None = None
    description: str | None = None

    @property
    def exposed(self) -> str:
        return self.name or self.tool


@dataclass(frozen=True)
class ContextConfig:
    """How the conversation is fitted to the model's context: `keep_all`; `drop_old_tool_outputs` (past
    `budget_tokens`, the oldest tool outputs become a short placeholder); `summarize` (past `budget_tokens`, the
    policy summarizes the older turns). The last `keep_recent` messages are never dropped or summarized."""
    strategy: str = "keep_all"
    budget_tokens: int = 32000
    keep_recent: int = 6
    summary_max_tokens: int = 1024


@dataclass(frozen=True)
class SubagentConfig:
    """The `delegate` tool's sub-episode: its harness (a preset name or a JSON file), how deep delegation may
    nest, whether it works on a fork of the sandbox (default) or on the same one, and its budget."""
    harness: str = "react"
    max_depth: int = 1
    share_sandbox: bool = False
    turns: int = 8
    tokens: int = 4096


@dataclass(frozen=True)
class HarnessConfig:
    name: str
    tools: tuple[ToolChoice, ...]
    system_prompt: str
    context: ContextConfig = field(default_factory=ContextConfig)
    memory_dir: str | None = None        # the memory module: notes under this directory (a `memory` tool)
    skills_dir: str | None = None        # the skills module: *.md skills in this directory (a `load_skill` tool)
    subagent: SubagentConfig | None = None   # the subagent module (a `delegate` tool)
    max_output_chars: int = 16000        # each tool result is cut to this many characters
    max_tokens_per_turn: int = 4096
    temperature: float = 1.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        _check(isinstance(self.name, str) and self.name, "name", self.name, "a non-empty string")
        _check(len(self.tools) > 0, "tools", list(self.tools), "at least one tool")
        seen = set()
        for i, t in enumerate(self.tools):
            _check(t.tool in BUILTIN_TOOLS, f"tools[{i}].tool", t.tool, f"one of {sorted(BUILTIN_TOOLS)}")
            _check(bool(_TOOL_NAME.match(t.exposed)), f"tools[{i}].name", t.exposed,
                   "1-64 letters, digits, '_' or '-'")
            _check(t.exposed not in seen, f"tools[{i}].name", t.exposed, "a name no other tool of the harness uses")
            seen.add(t.exposed)
        fields = [f for _, f, _, _ in string.Formatter().parse(self.system_prompt) if f is not None]
        for f in fields:
            _check(f in PROMPT_FIELDS, "system_prompt", "{" + f + "}", f"fields among {list(PROMPT_FIELDS)}")
        c = self.context
        _check(c.strategy in CONTEXT_STRATEGIES, "context.strategy", c.strategy, f"one of {list(CONTEXT_STRATEGIES)}")
        for name in ("budget_tokens", "summary_max_tokens"):
            _check(_positive_int(getattr(c, name)), f"context.{name}", getattr(c, name), "a positive integer")
        _check(isinstance(c.keep_recent, int) and c.keep_recent >= 0, "context.keep_recent", c.keep_recent,
               "an integer >= 0")
        names = {t.tool for t in self.tools}
        _check("memory" not in names or self.memory_dir, "memory_dir", self.memory_dir,
               "a directory when the 'memory' tool is listed")
        _check("load_skill" not in names or self.skills_dir, "skills_dir", self.skills_dir,
               "a directory when the 'load_skill' tool is listed")
        _check("delegate" not in names or self.subagent is not None, "subagent", self.subagent,
               "a subagent section when the 'delegate' tool is listed")
        if self.subagent is not None:
            s = self.subagent
            _check(isinstance(s.harness, str) and s.harness, "subagent.harness", s.harness, "a preset name or path")
            for name in ("max_depth", "turns", "tokens"):
                _check(_positive_int(getattr(s, name)), f"subagent.{name}", getattr(s, name), "a positive integer")
        for name in ("max_output_chars", "max_tokens_per_turn"):
            _check(_positive_int(getattr(self, name)), name, getattr(self, name), "a positive integer")
        _check(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2, "temperature",
               self.temperature, "a number in [0, 2]")

    # -- plain data in and out -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tools"] = [{k: v for k, v in t.items() if v is not None} for t in d["tools"]]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HarnessConfig":
        _check(isinstance(d, dict), "harness config", type(d).__name__, "a JSON object")
        d = dict(d)
        _check(isinstance(d.get("tools"), list), "tools", d.get("tools"), "a list of tool names or objects")
        d["tools"] = tuple(_tool_choice(t, i) for i, t in enumerate(d["tools"]))
        if "context" in d:
            d["context"] = _from_fields(ContextConfig, d["context"], "context")
        if d.get("subagent") is not None:
            d["subagent"] = _from_fields(SubagentConfig, d["subagent"], "subagent")
        return _from_fields(cls, d, "harness config")

    @classmethod
    def from_json(cls, path: str) -> "HarnessConfig":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise HarnessConfigError(f"harness config {path} is not valid JSON: {e}") from e
        return cls.from_dict(d)


def _tool_choice(v, i: int) -> ToolChoice:
    if isinstance(v, str):
        return ToolChoice(v)
    return _from_fields(ToolChoice, v, f"tools[{i}]")


def _from_fields(cls, d, where: str):
    _check(isinstance(d, dict), where, d, "a JSON object")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        _check(k in names, f"{where}.{k}", d[k], f"fields among {names}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for k in required:
        _check(k in d, f"{where}.{k}", None, "a value (the field is required)")
    try:
        return cls(**d)
    except TypeError as e:
        raise HarnessConfigError(f"{where}: {e}") from e


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check(ok, field_name: str, value, allowed: str) -> None:
    if not ok:
        raise HarnessConfigError(f"harness field '{field_name}' = {value!r} is invalid: expected {allowed}")


# --- a harness applied to one task -------------------------------------------------------------------------------

def build_tools(config: HarnessConfig, task: Task, depth: int = 0) -> dict[str, Tool]:
    """The tools of one episode, by exposed name. The harness's tools, or, when the task names its own tool set,
    those (exposed as the harness exposes them where it lists them); `submit` is always there; `delegate` only
    below the subagent depth limit."""
    choices = {t.tool: t for t in config.tools}
    wanted = list(choices) if task.tools is None else list(task.tools)
    if "submit" not in wanted:
        wanted.append("submit")
    tools: dict[str, Tool] = {}
    for base in wanted:
        if base not in BUILTIN_TOOLS:
            raise HarnessConfigError(f"task {task.id!r} asks for tool {base!r}; the tools are {sorted(BUILTIN_TOOLS)}")
        if (base == "memory" and not config.memory_dir) or (base == "load_skill" and not config.skills_dir) or \
                (base == "delegate" and (config.subagent is None or depth >= config.subagent.max_depth)):
            continue     # the module this tool belongs to is off in this harness (or too deep)
        choice = choices.get(base, ToolChoice(base))
        tool = BUILTIN_TOOLS[base].renamed(choice.name, choice.description)
        if tool.name in tools:
            raise HarnessConfigError(f"harness {config.name!r}: two tools of task {task.id!r} are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def submit_name(config: HarnessConfig) -> str:
    return next((t.exposed for t in config.tools if t.tool == "submit"), "submit")


def render_system_prompt(config: HarnessConfig, tools: dict[str, Tool], memory: MemoryStore | None,
                         skills: SkillLibrary | None) -> str:
    """The system prompt: the template with the tool list, workspace, skills, memory notes and submit name."""
    return config.system_prompt.format(
        tools="\n".join(f"- {t.name}: {t.description}" for t in tools.values()),
        workspace=WORKSPACE,
        skills=skills.render() if skills is not None else "(no skills)",
        memory=memory.render() if memory is not None else "(no memory)",
        submit=submit_name(config))
