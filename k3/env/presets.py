"""Harness presets and the harness sampler (report §4.2.1).

Presets are compositions in the style of common agents: `react` (a minimal reason-act loop: python, shell,
submit), `coder` (a coding agent: file tools, search and shell, a longer prompt, old tool outputs dropped past a
budget), `terminal` (one shell), `notes` (memory and skills). `load_harness` takes a preset name, a JSON file's
path, a dict or a config.

`HarnessSampler(seed).sample(group)` draws a random composition for a task group: tool set, an alias and a
description variant per tool, the prompt template, the context strategy and the optional modules. It is a pure
function of (seed, group), so every sample of a group sees the same harness and a rerun draws the same ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random

from k3.env.harness import ContextConfig, HarnessConfig, HarnessConfigError, SubagentConfig, ToolChoice

REACT_PROMPT = """You solve the user's task step by step: think, act with one of your tools, read the result, repeat.
Your workspace is {workspace}.

Tools:
{tools}

When you are done, call {submit} with your final answer."""

CODER_PROMPT = """You are a careful software engineer working in a code repository at {workspace}.

How to work:
- Explore before you change anything: list the files, search for the names involved, read the code you will touch.
- Make small, precise edits; prefer editing an exact snippet over rewriting a whole file.
- Run the code or its tests after each change and read the output; fix what fails before moving on.
- Do not ask the user questions: they are not watching. Decide, act and verify on your own.
- Old tool outputs may be replaced by a placeholder to save context: read a file again when you need it.

Tools:
{tools}

When the task is complete and verified, call {submit} with a short summary of what you did."""

TERMINAL_PROMPT = """You have a Linux terminal; your working directory is {workspace}.
Available tools:
{tools}
Finish by calling {submit} with your answer."""

NOTES_PROMPT = """You solve tasks in the workspace {workspace} with the tools below.

Tools:
{tools}

Skills (load one with its name when it helps):
{skills}

Your notes from earlier tasks of this kind (keep them short and useful; update them when you learn something):
{memory}

Call {submit} with your final answer when you are done."""

PRESETS: dict[str, HarnessConfig] = {c.name: c for c in [
    HarnessConfig("react", tuple(ToolChoice(t) for t in ("python", "shell", "submit")), REACT_PROMPT),
    HarnessConfig("coder", tuple(ToolChoice(t) for t in ("read_file", "write_file", "edit_file", "list_files",
                                                        "search", "shell", "submit")),
                  CODER_PROMPT, ContextConfig("drop_old_tool_outputs", budget_tokens=24000, keep_recent=6)),
    HarnessConfig("terminal", (ToolChoice("shell"), ToolChoice("submit")), TERMINAL_PROMPT),
    HarnessConfig("notes", tuple(ToolChoice(t) for t in ("shell", "python", "read_file", "write_file", "memory",
                                                        "load_skill", "submit")),
                  NOTES_PROMPT, memory_dir=os.path.join("k3-env", "memory"),
                  skills_dir=os.path.join("k3-env", "skills")),
]}


def load_harness(spec: "str | dict | HarnessConfig") -> HarnessConfig:
    """A harness from a preset name, a JSON file, a dict, or a config (returned as is)."""
    if isinstance(spec, HarnessConfig):
        return spec
    if isinstance(spec, dict):
        return HarnessConfig.from_dict(spec)
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    if isinstance(spec, str) and os.path.isfile(spec):
        return HarnessConfig.from_json(spec)
    raise HarnessConfigError(f"harness {spec!r} is neither a preset ({sorted(PRESETS)}) nor a JSON file")


# --- the sampler -------------------------------------------------------------------------------------------------

# Names other agents give the same tools. No alias appears twice, so any combination is a valid harness.
TOOL_ALIASES = {
    "shell": ("bash", "run_command", "terminal", "exec_command"),
    "python": ("run_python", "python_exec", "ipython"),
    "read_file": ("read", "view_file", "cat_file"),
    "write_file": ("write", "create_file", "save_file"),
    "edit_file": ("edit", "str_replace", "replace_in_file"),
    "list_files": ("ls", "list_dir", "glob_files"),
    "search": ("grep", "search_files", "find_text"),
    "submit": ("finish", "final_answer", "done"),
    "memory": ("notes", "remember"),
    "load_skill": ("skill", "read_skill"),
    "delegate": ("subagent", "spawn_agent"),
    "score_kernel": ("benchmark_kernel", "evaluate_kernel"),
}

# Other wordings of each tool's description (the tool's own description is always one of the choices).
DESCRIPTION_VARIANTS = {
    "shell": ("Execute a command line in a POSIX shell inside the workspace. Returns the exit status and output.",
              "Runs bash-style commands. Output is truncated when long."),
    "python": ("Execute a Python 3 script and get its printed output and exit status.",),
    "read_file": ("Return the contents of a file (optionally only some lines).",),
    "write_file": ("Write text to a file, replacing it if it exists.",),
    "edit_file": ("Exact string replacement in a file: old_string must match exactly one place.",),
    "list_files": ("Recursively list files below a folder.",),
    "search": ("grep -E over the workspace: prints path:line:match.",),
    "submit": ("Finish the task and hand in the final answer.", "Report the result. Use only once you are done."),
    "memory": ("Persistent notebook shared by tasks of the same family.",),
    "load_skill": ("Fetch the full text of a named skill.",),
    "delegate": ("Start a helper agent on a sub-task; it returns its answer when finished.",),
    "score_kernel": ("Evaluate a kernel candidate: correctness, speed and reward.",),
}

TOOL_SETS = {
    "react": ("python", "shell", "submit"),
    "coder": ("read_file", "write_file", "edit_file", "list_files", "search", "shell", "submit"),
    "terminal": ("shell", "submit"),
    "full": ("shell", "python", "read_file", "write_file", "edit_file", "list_files", "search", "submit"),
}

PROMPT_TEMPLATES = (REACT_PROMPT, CODER_PROMPT, TERMINAL_PROMPT, NOTES_PROMPT,
                    "Task environment. Workspace: {workspace}.\n{tools}\nSubmit via {submit}.")


@dataclasses.dataclass(frozen=True)
class HarnessSampler:
    """Draws harness compositions for RL task groups. `alias_p`: chance that a tool is renamed; `module_p`: chance
    of each optional module (memory and skills only where their directory is given; the subagent module always
    possible)."""
    seed: int
    memory_dir: str | None = None
    skills_dir: str | None = None
    alias_p: float = 0.5
    module_p: float = 0.3
    budgets: tuple[int, ...] = (8000, 16000, 32000)

    def sample(self, group: "str | int") -> HarnessConfig:
        key = hashlib.sha256(f"{self.seed}:{group}".encode()).digest()
        rng = random.Random(int.from_bytes(key[:8], "little"))
        tool_set = rng.choice(sorted(TOOL_SETS))
        tools = list(TOOL_SETS[tool_set])
        memory_dir = self.memory_dir if self.memory_dir and rng.random() < self.module_p else None
        skills_dir = self.skills_dir if self.skills_dir and rng.random() < self.module_p else None
        subagent = SubagentConfig(harness=rng.choice(("react", "terminal"))) if rng.random() < self.module_p else None
        tools[-1:-1] = [t for t, on in (("memory", memory_dir), ("load_skill", skills_dir), ("delegate", subagent))
                        if on]
        choices = []
        for t in tools:
            name = rng.choice(TOOL_ALIASES[t]) if rng.random() < self.alias_p else None
            description = rng.choice((None,) + DESCRIPTION_VARIANTS[t])
            choices.append(ToolChoice(t, name, description))
        prompt = rng.choice(PROMPT_TEMPLATES)
        if skills_dir and "{skills}" not in prompt:
            prompt += "\n\nSkills:\n{skills}"
        if memory_dir and "{memory}" not in prompt:
            prompt += "\n\nNotes from earlier tasks:\n{memory}"
        strategy = rng.choice(("keep_all", "drop_old_tool_outputs", "summarize"))
        context = ContextConfig(strategy, budget_tokens=rng.choice(self.budgets), keep_recent=rng.choice((4, 6, 8)))
        return HarnessConfig(f"sampled-{self.seed}-{group}-{tool_set}", tuple(choices), prompt, context,
                             memory_dir=memory_dir, skills_dir=skills_dir, subagent=subagent)

