"""SFT cold-start demonstrations (report §4.1.2): each task's scripted solution played through a real episode.

    jobs = plan_demo_jobs(parse_task_specs(["arith:200", "code:50"]), ["terminal", "coder"], split="train")
    report = make_demos(jobs, concurrency=4, sandbox_kind="bwrap")
    write_demos("demos.jsonl", report.records)       # `k3 sft --data demos.jsonl`

Every (task, harness) job is one `Episode` run like a model's (`k3 env run`): the same harness, system prompt, tool
specs, sandbox and hidden verifier, so the SFT data shows the model exactly what its RL rollouts will. Only the
policy differs: it plays the family's `scripted_solution(task)`, one tool call per assistant message (no content
text), each tool under the name the harness exposes it by. Where the harness lacks a tool the script uses, an
available tool stands in (`stand_ins=True`, the default): `write_file` becomes a shell heredoc (or Python), `python`
becomes `python3 - <<EOF` in the shell, `shell` becomes a Python subprocess; `score_kernel` (diagnostic only: the
verifier scores the final kernel file anyway) is left out. A tool with no stand-in makes the job fail, naming it.

A demonstration is kept when the hidden verdict is a success, no tool call failed, and the chat template renders
the conversation with a trained span for every assistant message (`k3.serve.chat.render_chat_segments`, what `k3
sft` renders); everything else is counted with the reason. One record per kept episode, in job order (the file does
not depend on `concurrency`):

    {"messages": the episode's messages (system, user, assistant with tool_calls, tool results, ...),
     "tools": the episode's tool specs, "task_id", "family", "split", "harness"}

`messages` is the whole conversation as the episode stored it; a harness whose context strategy drops or
summarizes old turns shows the model less than that only past its budget, which short scripted solutions do not
reach (a summary request is answered with a fixed line).
"""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field

from k3.env.client import ScriptedPolicy, assistant_message, tool_call
from k3.env.context import SUMMARY_PROMPT
from k3.env.episode import Episode
from k3.env.harness import HarnessConfig, build_tools
from k3.env.presets import load_harness
from k3.env.run import Job, plan_jobs, run_pooled
from k3.env.sandbox import Limits
from k3.env.task import Task, get_family
from k3.env.toolbox import BUILTIN_TOOLS
from k3.env.tools import Tool
from k3.files import atomic_write_text

__all__ = ["DemoOutcome", "DemoReport", "NoStandIn", "check_scripted", "demo_record", "exposed_names", "format_counts",
           "make_demo", "make_demos",
           "plan_demo_jobs", "scripted_messages", "write_demos"]

# Tools that may stand in for one the harness lacks, in order of preference; tools that may be left out.
STAND_INS = {"write_file": ("shell", "python"), "python": ("shell",), "shell": ("python",)}
OPTIONAL_TOOLS = ("score_kernel",)
SUMMARY_TEXT = "The earlier turns ran the tool calls shown; continue from the latest results."


class NoStandIn(ValueError):
    """The harness lacks a tool the scripted solution uses, and no tool of it can stand in."""


def check_scripted(families) -> None:
    """Raise ValueError naming every family (of the names given) whose class has no `scripted_solution`."""
    names = list(dict.fromkeys(families))
    missing = [n for n in names if not callable(getattr(get_family(n), "scripted_solution", None))]
    if missing:
        raise ValueError(f"task famil{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)} "
                         f"{'has' if len(missing) == 1 else 'have'} no scripted_solution(task): "
                         f"no demonstrations can be made of {'it' if len(missing) == 1 else 'them'}")


def plan_demo_jobs(specs: list[tuple[str, int]], harnesses: list[str], split: str = "train",
                   seed: int = 0) -> list[Job]:
    """`k3.env.run.plan_jobs` (every instance once per harness), after checking every family has a scripted
    solution."""
    check_scripted(f for f, _ in specs)
    return plan_jobs(specs, harnesses, split=split, seed=seed)


# --- the scripted assistant messages -------------------------------------------------------------------------------

def exposed_names(tools: dict[str, Tool]) -> dict[str, str]:
    """{built-in tool name: the name an episode's tools expose it by} for the built-in tools among `tools`."""
    out = {}
    for name, t in tools.items():
        for base, b in BUILTIN_TOOLS.items():
            if t.fn is b.fn:
                out[base] = name
    return out


def scripted_messages(task: Task, tools: dict[str, Tool], stand_ins: bool = True) -> list[dict]:
    """The assistant messages that play `task`'s scripted solution with the episode's `tools` (by exposed name, as
    `k3.env.harness.build_tools` makes them): one tool call each. Raises NoStandIn when a tool is missing and
    cannot be replaced, ValueError when the task has no scripted solution."""
    names = exposed_names(tools)
    out = []
    for a in get_family(task.family).scripted_solution(task):
        call = _call_for(a["tool"], dict(a["args"]), names, stand_ins)
        if call is not None:
            out.append(assistant_message(None, [tool_call(*call)]))
    return out


def _call_for(tool: str, args: dict, names: dict[str, str], stand_ins: bool) -> tuple[str, dict] | None:
    if tool in names:
        return names[tool], args
    if stand_ins and tool in OPTIONAL_TOOLS:
        return None
    if stand_ins:
        for alt in STAND_INS.get(tool, ()):
            if alt in names:
                return names[alt], _STAND_IN_ARGS[(tool, alt)](**args)
    raise NoStandIn(f"the scripted solution calls {tool!r}, which the harness does not offer"
                    + (" and no tool of it can stand in for" if stand_ins else " (stand-ins are off)")
                    + f" (its tools: {sorted(names)})")


def _delimiter(body: str) -> str:
    tag = "EOF"
    while tag in body.splitlines():
        tag += "_"
    return tag


def _write_by_shell(path: str, content: str) -> dict:
    mkdir = f"mkdir -p {shlex.quote(path.rsplit('/', 1)[0])} && " if "/" in path.strip("/") else ""
    if content.endswith("\n"):
        tag = _delimiter(content)
        return {"command": f"{mkdir}cat > {shlex.quote(path)} <<'{tag}'\n{content}{tag}"}
    return {"command": f"{mkdir}printf '%s' {shlex.quote(content)} > {shlex.quote(path)}"}


def _write_by_python(path: str, content: str) -> dict:
    return {"code": f"from pathlib import Path\n\np = Path({path!r})\np.parent.mkdir(parents=True, exist_ok=True)\n"
                    f"p.write_text({content!r})\n"}


def _python_by_shell(code: str, timeout: float | None = None) -> dict:
    body = code if code.endswith("\n") else code + "\n"
    tag = _delimiter(body)
    return {"command": f"python3 - <<'{tag}'\n{body}{tag}", **({"timeout": timeout} if timeout else {})}


def _shell_by_python(command: str, timeout: float | None = None) -> dict:
    return {"code": f"import subprocess, sys\n\nr = subprocess.run({command!r}, shell=True, capture_output=True, "
                    f"text=True)\nsys.stdout.write(r.stdout)\nsys.stderr.write(r.stderr)\nsys.exit(r.returncode)\n",
            **({"timeout": timeout} if timeout else {})}


_STAND_IN_ARGS = {("write_file", "shell"): _write_by_shell, ("write_file", "python"): _write_by_python,
                  ("python", "shell"): _python_by_shell, ("shell", "python"): _shell_by_python}


def _demo_policy(messages: list[dict]) -> ScriptedPolicy:
    """Plays `messages` in order; a context-summary request (the harness's summarize strategy) gets a fixed line
    and consumes none of them."""
    it = iter(messages)

    def play(view: list[dict]) -> dict:
        if view and view[0].get("role") == "system" and view[0].get("content") == SUMMARY_PROMPT:
            return assistant_message(SUMMARY_TEXT)
        try:
            return next(it)
        except StopIteration:   # the solution ended without ending the episode: say so, the episode ends
            return assistant_message("(the scripted solution has no more steps)")

    return ScriptedPolicy(play)


# --- one demonstration -------------------------------------------------------------------------------------------

@dataclass
class DemoOutcome:
    task_id: str
    family: str
    harness: str
    record: dict | None          # the SFT record, when kept
    reason: str | None = None    # why it was not kept
    wall_s: float = 0.0

    @property
    def kept(self) -> bool:
        return self.record is not None


def demo_record(messages: list[dict], tools: list[dict], task: Task, harness: str) -> dict:
    """The SFT record of a conversation, after checking the chat template renders it with a trained span for
    every assistant message (ValueError otherwise)."""
    from k3.serve.chat import render_chat_segments

    segments = render_chat_segments(messages, add_generation_prompt=False, tools=tools)
    trained = {s.message for s in segments if s.train}
    untrained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i not in trained]
    if untrained:
        raise ValueError(f"the chat template trains nothing of assistant messages {untrained}")
    return {"messages": messages, "tools": tools, "task_id": task.id, "family": task.family, "split": task.split,
            "harness": harness}


def make_demo(task: Task, harness: str | dict | HarnessConfig, *, sandbox_kind: str = "bwrap",
              limits: Limits | None = None, kernel_device: str = "cpu", stand_ins: bool = True) -> DemoOutcome:
    """Play `task`'s scripted solution through one episode with `harness`; never raises for what the solution,
    the sandbox or the verifier do (the outcome says why nothing was kept)."""
    config = load_harness(harness)
    t0 = time.monotonic()

    def failed(reason: str) -> DemoOutcome:
        return DemoOutcome(task.id, task.family, config.name, None, reason, time.monotonic() - t0)

    try:
        script = scripted_messages(task, build_tools(config, task), stand_ins)
    except ValueError as e:      # no scripted solution for this instance, or a tool nothing stands in for
        return failed(f"no demonstration: {e}")
    episode = Episode(task, config, _demo_policy(script), sandbox_kind=sandbox_kind, limits=limits,
                      kernel_device=kernel_device)
    traj = episode.run()
    if traj.end_reason == "error":
        return failed(f"the episode failed: {traj.error}")
    if not traj.success:
        details = (traj.verdict or {}).get("details") or "no verdict"
        return failed(f"the hidden verifier refused it (end: {traj.end_reason}): {details.strip()[:300]}")
    if traj.counts["tool_errors"]:
        first = next((m["content"] for m in traj.messages if m["role"] == "tool"
                      and m["content"].startswith("ERROR: ")), "")
        return failed(f"{traj.counts['tool_errors']} tool call(s) failed: {first[:300]}")
    try:
        record = demo_record(traj.messages, episode.tool_specs(), task, config.name)
    except ValueError as e:
        return failed(f"the chat template cannot render it: {e}")
    return DemoOutcome(task.id, task.family, config.name, record, None, traj.wall_s)


# --- many ----------------------------------------------------------------------------------------------------------

@dataclass
class DemoReport:
    outcomes: list[DemoOutcome] = field(default_factory=list)   # in job order

    @property
    def records(self) -> list[dict]:
        return [o.record for o in self.outcomes if o.kept]

    @property
    def failures(self) -> list[DemoOutcome]:
        return [o for o in self.outcomes if not o.kept]

    def per_family(self) -> dict[str, tuple[int, int]]:
        """{family: (kept, total)} in the order families first appear."""
        total, kept = Counter(), Counter()
        for o in self.outcomes:
            total[o.family] += 1
            kept[o.family] += o.kept
        return {f: (kept[f], total[f]) for f in total}


def make_demos(jobs: list[Job], *, concurrency: int = 4, sandbox_kind: str = "bwrap", limits: Limits | None = None,
               kernel_device: str = "cpu", stand_ins: bool = True, progress: bool = True) -> DemoReport:
    """Every job's demonstration, `concurrency` episodes at a time; the report keeps the jobs' order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    outcomes: list[DemoOutcome | None] = [None] * len(jobs)
    kept = 0

    def one(i: int) -> DemoOutcome:
        job = jobs[i]
        return make_demo(job.task, job.harness, sandbox_kind=sandbox_kind, limits=limits,
                         kernel_device=kernel_device, stand_ins=stand_ins)

    def done(k: int, i: int, out: DemoOutcome) -> str:
        nonlocal kept
        outcomes[i] = out
        kept += out.kept
        return f"kept={kept}/{k + 1}"

    run_pooled(list(range(len(jobs))), one, done, concurrency=concurrency, desc="k3 env demos", progress=progress)
    return DemoReport(outcomes)


def format_counts(report: DemoReport) -> str:
    """"arith 198/200, code 50/50": kept/total per family."""
    return ", ".join(f"{f} {k}/{n}" for f, (k, n) in report.per_family().items())


def write_demos(path: str, records: list[dict]) -> None:
    """The records as JSON Lines, written atomically (the old file stays whole until the new one is complete)."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
