"""The built-in tools, by name in `BUILTIN_TOOLS`: shell, python, the file tools, search, submit, score_kernel, and
the tools of the optional modules (memory, load_skill, delegate).

Commands run inside the sandbox (`Sandbox.exec`), each bounded by the episode's remaining wall time; file tools go
through the sandbox's host-side file methods, which refuse any path leaving the workspace.
"""

from __future__ import annotations

import os

from k3.env.sandbox import WORKSPACE, ExecResult
from k3.env.task import Verdict
from k3.env.tools import Tool, ToolContext, ToolError, integer, number, params, string, truncate, verdict_text

KERNEL_RESULT_CHARS = 4000      # the kernel reward's summary is a few lines; its check list can be long


def exec_text(r: ExecResult) -> str:
    """A command's result as the agent reads it: the exit status, then stdout and stderr when not empty."""
    if r.timed_out:
        status = f"timed out after {r.wall_s:.1f} s (killed)"
    elif r.exit_code is None:
        status = f"killed by {r.signal or 'a signal'}"
    else:
        status = f"exit code {r.exit_code}"
    parts = [status]
    if r.stdout:
        parts.append("stdout:\n" + r.stdout)
    if r.stderr:
        parts.append("stderr:\n" + r.stderr)
    if r.truncated:
        parts.append("[output cut to the sandbox's per-call limit]")
    return "\n".join(parts)


def _shell(ctx: ToolContext, command: str, timeout: float | None = None) -> str:
    return exec_text(ctx.sandbox.exec(command, timeout=ctx.time_left(timeout)))


def _python(ctx: ToolContext, code: str, timeout: float | None = None) -> str:
    return exec_text(ctx.sandbox.exec(["python3", "-"], stdin=code, timeout=ctx.time_left(timeout)))


def _read_file(ctx: ToolContext, path: str, start_line: int = 1, end_line: int | None = None) -> str:
    text = ctx.sandbox.read_file(path).decode("utf-8", "replace")
    if start_line == 1 and end_line is None:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(lines[start_line - 1:end_line])


def _write_file(ctx: ToolContext, path: str, content: str) -> str:
    ctx.sandbox.write_file(path, content)
    return f"wrote {len(content.encode())} bytes to {path}"


def _edit_file(ctx: ToolContext, path: str, old_string: str, new_string: str) -> str:
    if not old_string:
        raise ToolError("old_string is empty: give the exact text to replace")
    text = ctx.sandbox.read_file(path).decode("utf-8", "replace")
    n = text.count(old_string)
    if n != 1:
        raise ToolError(f"old_string occurs {n} times in {path}; it must occur exactly once "
                        f"({'add surrounding lines to make it unique' if n else 'copy it exactly from the file'})")
    ctx.sandbox.write_file(path, text.replace(old_string, new_string, 1))
    return f"replaced 1 occurrence in {path}"


def _list_files(ctx: ToolContext, path: str = ".") -> str:
    files = ctx.sandbox.list_files(path)
    return "\n".join(files) if files else f"(no files under {path})"


def _workspace_relative(ctx: ToolContext, path: str) -> str:
    """`path` as a path relative to the workspace, checked to stay inside it (commands run in the workspace)."""
    return os.path.relpath(ctx.sandbox.host_path(path), os.path.realpath(ctx.sandbox.workspace))


def _search(ctx: ToolContext, pattern: str, path: str = ".", max_per_file: int = 50) -> str:
    # grep runs inside the sandbox, so the agent's regular expression never runs in the host process; without a
    # path it searches the working directory (the workspace) and prints paths without a "./" prefix.
    rel = _workspace_relative(ctx, path)
    argv = ["grep", "-rnIE", "-m", str(max_per_file), "-e", pattern, "--"] + ([] if rel == "." else [rel])
    r = ctx.sandbox.exec(argv, timeout=ctx.time_left(30.0))
    if r.exit_code == 1:
        return f"no match for {pattern!r} under {path}"
    if r.exit_code != 0:
        raise ToolError(f"search failed: {exec_text(r)}")
    return r.stdout + ("\n[matches cut to the sandbox's per-call limit]" if r.truncated else "")


def _submit(ctx: ToolContext, answer: str) -> str:
    """Without a public verifier: the answer is final and the episode ends. With one: the verifier's feedback, at
    most `task.max_submissions` times; the episode ends at the first success or when no submission is left."""
    task = ctx.task
    if task.public_verify is None:
        ctx.answer, ctx.submissions, ctx.finished = answer, ctx.submissions + 1, True
        return "answer submitted"
    if ctx.submissions >= task.max_submissions:
        raise ToolError(f"no submissions left (at most {task.max_submissions})")
    ctx.answer = answer
    ctx.submissions += 1
    fork = ctx.sandbox.fork()      # the verifier judges a copy: nothing it does reaches the agent's workspace
    try:
        verdict = task.public_verify(fork, answer)
    finally:
        fork.close()
    if not isinstance(verdict, Verdict):
        raise TypeError(f"task {task.id!r}: public_verify returned {type(verdict).__name__}, not Verdict")
    ctx.public_verdicts.append(verdict.to_dict())
    left = task.max_submissions - ctx.submissions
    ctx.finished = verdict.success or left == 0
    return f"submission {ctx.submissions} of {task.max_submissions}\n{verdict_text(verdict)}" + \
        ("" if ctx.finished else f"\n{left} submission(s) left")


def _score_kernel(ctx: ToolContext, path: str, task: str | None = None) -> str:
    name = task or ctx.task.metadata.get("kernel_task")
    if not name:
        raise ToolError("name the kernel task: this task has no default kernel task")
    source = ctx.sandbox.read_file(path).decode("utf-8", "replace")
    try:
        from k3.kernel_reward import score
        result = score(name, source, device=ctx.kernel_device)
    except ImportError as e:
        raise ToolError(f"the kernel reward is not available here: {e}") from e
    except KeyError as e:
        raise ToolError(str(e.args[0]) if e.args else str(e)) from e
    return truncate(result.summary(), KERNEL_RESULT_CHARS)


def _memory(ctx: ToolContext, action: str, key: str | None = None, content: str | None = None) -> str:
    if ctx.memory is None:
        raise ToolError("memory is not enabled in this harness")
    if action == "read":
        return ctx.memory.render()
    if not key:
        raise ToolError(f"action {action!r} needs a 'key'")
    if action == "write":
        if content is None:
            raise ToolError("action 'write' needs 'content'")
        try:
            ctx.memory.write(key, content)
        except ValueError as e:
            raise ToolError(str(e)) from e
        return f"saved note {key!r}"
    return f"deleted note {key!r}" if ctx.memory.delete(key) else f"no note {key!r}"


def _load_skill(ctx: ToolContext, name: str) -> str:
    if ctx.skills is None:
        raise ToolError("skills are not enabled in this harness")
    skill = ctx.skills.get(name)
    if skill is None:
        raise ToolError(f"no skill {name!r}; the skills are {ctx.skills.names()}")
    return skill.body


def _delegate(ctx: ToolContext, instructions: str) -> str:
    if ctx.delegate is None:
        raise ToolError("delegation is not available here (no sub-agent, or the depth limit is reached)")
    return ctx.delegate(instructions)


_TIMEOUT = number("seconds the command may run (bounded by the sandbox and the episode's time)", minimum=1)

BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in [
    Tool("shell", "Run a shell command (/bin/sh -c) in the workspace and return its exit code, stdout and stderr.",
         params({"command": string("the command line")}, {"timeout": _TIMEOUT}), _shell),
    Tool("python", "Run a Python program in the workspace (python3, the code given on stdin) and return its "
         "exit code, stdout and stderr.", params({"code": string("the program")}, {"timeout": _TIMEOUT}), _python),
    Tool("read_file", "Read a text file of the workspace, whole or a range of lines.",
         params({"path": string(f"a path relative to the workspace ({WORKSPACE})")},
                {"start_line": integer("first line, from 1", minimum=1),
                 "end_line": integer("last line, included", minimum=1)}), _read_file),
    Tool("write_file", "Create or overwrite a file of the workspace with the given content.",
         params({"path": string("a path relative to the workspace"), "content": string("the whole new content")}),
         _write_file),
    Tool("edit_file", "Replace one exact occurrence of a string in a workspace file; the string must occur exactly "
         "once.", params({"path": string("a path relative to the workspace"),
                          "old_string": string("the exact text to replace, unique in the file"),
                          "new_string": string("the text to put in its place")}), _edit_file),
    Tool("list_files", "List the files under a directory of the workspace, recursively.",
         params(optional={"path": string("a directory relative to the workspace (default: the workspace)")}),
         _list_files),
    Tool("search", "Search the workspace's text files for an extended regular expression; returns file:line:text "
         "for each match.", params({"pattern": string("an extended regular expression (grep -E)")},
                                   {"path": string("a file or directory to search (default: the workspace)")}),
         _search),
    Tool("submit", "Submit your final answer. Call it once you are done.",
         params({"answer": string("the answer, or a short summary of what you did")}), _submit),
    Tool("score_kernel", "Score a candidate kernel file with the kernel reward: correctness checks, timing and "
         "reward.", params({"path": string("the candidate's file in the workspace (defines `kernel`)")},
                           {"task": string("the kernel task's name (default: this task's)")}), _score_kernel),
    Tool("memory", "Notes that persist across tasks of this kind: read them, write one under a key, or delete one.",
         params({"action": string("what to do", enum=["read", "write", "delete"])},
                {"key": string("the note's key"), "content": string("the note (for write)")}), _memory),
    Tool("load_skill", "Load the instructions of a skill listed in the system prompt.",
         params({"name": string("the skill's name")}), _load_skill),
    Tool("delegate", "Hand a self-contained sub-task to a sub-agent that works in a copy of the workspace; returns "
         "its final answer.", params({"instructions": string("everything the sub-agent needs to know")}),
         _delegate),
]}
