"""The harness modules: tool schemas and argument validation, every built-in tool against a sandbox, context
strategies, memory, skills, subagents, harness configs and presets, and the harness sampler."""

import json
import os
import shutil

import pytest

import k3.kernel_reward
from k3.env.client import ScriptedPolicy, assistant_message, estimate_tokens, tool_call
from k3.env.context import ContextManager
from k3.env.episode import Episode
from k3.env.harness import ContextConfig, HarnessConfig, HarnessConfigError, ToolChoice, build_tools
from k3.env.memory import MemoryStore
from k3.env.presets import (DESCRIPTION_VARIANTS, PRESETS, TOOL_ALIASES, HarnessSampler, load_harness)
from k3.env.sandbox import create_sandbox
from k3.env.skills import SkillLibrary
from k3.env.task import Task, Verdict
from k3.env.toolbox import BUILTIN_TOOLS
from k3.env.tools import ERROR_PREFIX, ToolContext, call_tool, check_value, truncate


def _kinds():
    kinds = ["none"]
    if shutil.which("bwrap") and os.path.exists(os.path.join(os.path.dirname(__file__), "../../k3/env/bwrap.py")):
        kinds.append("bwrap")
    return kinds


def _task(**kw):
    kw.setdefault("verify", lambda sb, a: Verdict(1.0, True))
    return Task(id="t", family=kw.pop("family", "fam"), prompt="do it", **kw)


@pytest.fixture(params=_kinds())
def ctx(request):
    sb = create_sandbox(request.param)
    sb.write_file("src/a.py", "def f():\n    return 1\n\nprint(f())\n")
    sb.write_file("notes.txt", "alpha\nbeta\ngamma\n")
    yield ToolContext(sb, _task(metadata={"kernel_task": "rms_norm"}))
    sb.close()


def run(ctx, name, args, limit=16000):
    return call_tool(BUILTIN_TOOLS, ctx, name, json.dumps(args), limit)


# --- schemas and validation --------------------------------------------------------------------------------------

def test_every_tool_has_an_openai_spec_from_its_one_schema():
    for name, tool in BUILTIN_TOOLS.items():
        spec = tool.spec()
        assert spec["type"] == "function" and spec["function"]["name"] == name
        p = spec["function"]["parameters"]
        assert p["type"] == "object" and p["additionalProperties"] is False
        assert set(p["required"]) <= set(p["properties"])
        assert spec["function"]["parameters"] is tool.parameters
    alias = BUILTIN_TOOLS["shell"].renamed("bash", "Run bash.")
    assert alias.spec()["function"]["name"] == "bash" and alias.fn is BUILTIN_TOOLS["shell"].fn


def test_argument_validation_messages():
    schema = BUILTIN_TOOLS["read_file"].parameters
    assert check_value(schema, {"path": "a"}, "arguments") == []
    assert check_value(schema, {}, "arguments") == ["missing required argument 'path'"]
    assert check_value(schema, {"path": "a", "start_line": True}, "arguments") == \
        ["argument 'start_line' must be integer, got bool True"]
    assert check_value(schema, {"path": "a", "start_line": 0}, "arguments") == \
        ["argument 'start_line' must be >= 1, got 0"]
    assert "unexpected argument 'x'" in check_value(schema, {"path": "a", "x": 1}, "arguments")[0]
    mem = BUILTIN_TOOLS["memory"].parameters
    assert check_value(mem, {"action": "forget"}, "arguments") == \
        ["argument 'action' must be one of ['read', 'write', 'delete'], got 'forget'"]


def test_tool_output_is_truncated_with_a_note(ctx):
    out = run(ctx, "python", {"code": "print('x' * 5000)"}, limit=300)
    assert len(out.text) < 400 and "characters cut" in out.text and out.text.startswith("exit code 0")
    assert truncate("short", 10) == "short"


# --- each built-in tool ------------------------------------------------------------------------------------------

def test_shell_and_python(ctx):
    out = run(ctx, "shell", {"command": "cat notes.txt | wc -l; echo oops >&2; exit 3"})
    assert not out.error and out.text.splitlines()[0] == "exit code 3"
    assert "3" in out.text.split("stdout:")[1] and "stderr:\noops" in out.text
    out = run(ctx, "python", {"code": "import sys\nprint(sum(range(10)))\nsys.exit(0)"})
    assert out.text == "exit code 0\nstdout:\n45\n"
    out = run(ctx, "shell", {"command": "sleep 5", "timeout": 1})
    assert out.text.startswith("timed out")


def test_file_tools(ctx):
    assert run(ctx, "read_file", {"path": "notes.txt", "start_line": 2, "end_line": 3}).text == "beta\ngamma\n"
    assert run(ctx, "write_file", {"path": "d/new.txt", "content": "hello"}).text == "wrote 5 bytes to d/new.txt"
    assert ctx.sandbox.read_file("d/new.txt") == b"hello"
    out = run(ctx, "edit_file", {"path": "src/a.py", "old_string": "return 1", "new_string": "return 2"})
    assert not out.error and b"return 2" in ctx.sandbox.read_file("src/a.py")
    out = run(ctx, "edit_file", {"path": "notes.txt", "old_string": "a\n", "new_string": "A\n"})
    assert out.error and "occurs 3 times" in out.text
    out = run(ctx, "edit_file", {"path": "notes.txt", "old_string": "delta", "new_string": "x"})
    assert out.error and "occurs 0 times" in out.text
    assert run(ctx, "list_files", {}).text.splitlines() == ["d/new.txt", "notes.txt", "src/a.py"]
    out = run(ctx, "read_file", {"path": "../../etc/passwd"})
    assert out.error and out.text.startswith(ERROR_PREFIX) and "outside the workspace" in out.text
    assert run(ctx, "read_file", {"path": "missing.txt"}).error


def test_search(ctx):
    out = run(ctx, "search", {"pattern": "ret(urn|ry) [0-9]"})
    assert out.text.strip() == "src/a.py:2:    return 1"
    assert "no match" in run(ctx, "search", {"pattern": "zzz", "path": "src"}).text
    assert run(ctx, "search", {"pattern": "x", "path": "/etc"}).error


def test_submit_without_public_verifier_ends(ctx):
    out = run(ctx, "submit", {"answer": "7"})
    assert out.text == "answer submitted" and ctx.finished and ctx.answer == "7"


def test_score_kernel_reports_the_kernel_reward(ctx, monkeypatch):
    seen = {}

    class Result:
        def summary(self):
            return "rms_norm: candidate on cpu: reward 0.500\n" + "check\n" * 5000

    def fake_score(task, source, device=None):
        seen.update(task=task, source=source, device=device)
        return Result()
    monkeypatch.setitem(vars(k3.kernel_reward), "score", fake_score)   # (getattr would import torch)
    ctx.sandbox.write_file("k.py", "def kernel(x): return x\n")
    out = run(ctx, "score_kernel", {"path": "k.py"})
    assert seen == {"task": "rms_norm", "source": "def kernel(x): return x\n", "device": "cpu"}
    assert out.text.startswith("rms_norm: candidate on cpu: reward 0.500") and len(out.text) < 4200
    ctx.task.metadata.clear()
    assert "name the kernel task" in run(ctx, "score_kernel", {"path": "k.py"}).text


# --- memory, skills, subagents -----------------------------------------------------------------------------------

def test_memory_persists_across_episodes_of_a_family_only(tmp_path):
    cfg = HarnessConfig("mem", (ToolChoice("shell"), ToolChoice("memory", "notes"), ToolChoice("submit")),
                        "Notes:\n{memory}", memory_dir=str(tmp_path))
    write = [assistant_message(None, [tool_call("notes", {"action": "write", "key": "tip", "content": "use -n"})]),
             assistant_message("ok")]
    Episode(_task(family="alpha"), cfg, ScriptedPolicy(write), sandbox_kind="none").run()
    read = ScriptedPolicy([assistant_message(None, [tool_call("notes", {"action": "read"})]), assistant_message("ok")])
    traj = Episode(_task(family="alpha"), cfg, read, sandbox_kind="none").run()
    assert "- tip: use -n" in traj.messages[0]["content"]              # in the system prompt
    assert traj.messages[3]["content"] == "- tip: use -n"              # and through the tool
    other = Episode(_task(family="beta"), cfg, ScriptedPolicy([assistant_message("ok")]), sandbox_kind="none").run()
    assert "(no notes yet)" in other.messages[0]["content"]
    assert json.load(open(tmp_path / "alpha.json"))["notes"] == {"tip": "use -n"}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    store = MemoryStore(str(tmp_path), "alpha")
    assert store.delete("tip") and store.notes() == {}


def test_skills_are_listed_and_loaded(tmp_path):
    (tmp_path / "git-bisect.md").write_text("---\ndescription: find the commit that broke it\n---\n# Bisect\nRun git "
                                            "bisect start.\n")
    (tmp_path / "plain.md").write_text("\n# Plain skill\nbody\n")
    lib = SkillLibrary(str(tmp_path))
    assert lib.render() == "- git-bisect: find the commit that broke it\n- plain: Plain skill"
    cfg = HarnessConfig("sk", (ToolChoice("load_skill"), ToolChoice("submit")), "Skills:\n{skills}",
                        skills_dir=str(tmp_path))
    script = [assistant_message(None, [tool_call("load_skill", {"name": "git-bisect"}),
                                       tool_call("load_skill", {"name": "nope"})]), assistant_message("done")]
    traj = Episode(_task(), cfg, ScriptedPolicy(script), sandbox_kind="none").run()
    assert "git-bisect: find the commit" in traj.messages[0]["content"]
    assert traj.messages[3]["content"] == "# Bisect\nRun git bisect start.\n"
    assert "no skill 'nope'" in traj.messages[4]["content"] and traj.counts["tool_errors"] == 1


def test_delegate_runs_a_sub_episode_on_a_fork():
    cfg = {"name": "boss", "tools": ["shell", "delegate", "submit"], "system_prompt": "{tools}",
           "subagent": {"harness": "terminal", "turns": 4}}

    def policy(messages):
        if messages[0]["content"].startswith("You have a Linux terminal"):      # the sub-agent (terminal preset)
            if messages[-1]["role"] == "user":
                return assistant_message(None, [tool_call("shell", {"command": "echo sub > sub.txt; cat data"})])
            return assistant_message(None, [tool_call("submit", {"answer": "data says " + messages[-1]["content"]
                                                                 .split("stdout:\n")[1].strip()})])
        if messages[-1]["role"] == "user":
            return assistant_message(None, [tool_call("delegate", {"instructions": "read the file data"})])
        return assistant_message(None, [tool_call("submit", {"answer": messages[-1]["content"]})])

    def verify(sandbox, answer):      # the sub-agent worked on a fork: its file is not in the parent's sandbox
        absent = "sub.txt" not in sandbox.list_files()
        return Verdict(float(absent), absent)
    task = _task(image={"data": "17\n"}, verify=verify)
    traj = Episode(task, cfg, ScriptedPolicy(policy), sandbox_kind="none").run()
    assert traj.answer == "data says 17" and traj.end_reason == "submitted" and traj.success
    assert len(traj.subagents) == 1 and traj.subagents[0]["end_reason"] == "submitted"
    assert traj.subagents[0]["task_id"] == "t/sub1" and traj.subagents[0]["verdict"] is None
    # the sub-agent had no delegate tool (depth limit)
    assert "delegate" not in traj.subagents[0]["messages"][0]["content"]


def test_delegate_on_the_same_sandbox_shares_its_files():
    cfg = {"name": "boss", "tools": ["delegate", "submit"], "system_prompt": "{tools}",
           "subagent": {"harness": "terminal", "share_sandbox": True}}
    script = [assistant_message(None, [tool_call("delegate", {"instructions": "write 42 to answer.txt"})]),
              assistant_message(None, [tool_call("shell", {"command": "echo 42 > answer.txt"})]),
              assistant_message(None, [tool_call("submit", {"answer": "written"})]),
              assistant_message(None, [tool_call("submit", {"answer": "the sub-agent wrote it"})])]

    def verify(sandbox, answer):
        ok = sandbox.read_file("answer.txt") == b"42\n"
        return Verdict(float(ok), ok)
    traj = Episode(_task(verify=verify), cfg, ScriptedPolicy(script), sandbox_kind="none").run()
    assert traj.success and traj.messages[3]["content"] == "written"
    assert traj.counts["turns"] == 2 and traj.subagents[0]["counts"]["turns"] == 2


# --- context strategies -----------------------------------------------------------------------------------------

def _conversation(n_turns, out_chars=2000):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for i in range(n_turns):
        msgs.append(assistant_message(f"turn {i}", [tool_call("shell", {"command": "ls"}, id=f"c{i}")]))
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "name": "shell", "content": str(i) * out_chars})
    return msgs


def test_drop_old_tool_outputs_drops_oldest_first():
    msgs = _conversation(6)                         # ~6 * 500 tokens of tool output
    cm = ContextManager(ContextConfig("drop_old_tool_outputs", budget_tokens=1800, keep_recent=2))
    view, info = cm.view(msgs, policy=None)
    assert estimate_tokens(view) <= 1800 and len(view) == len(msgs)
    dropped = [i for i, m in enumerate(view) if m["role"] == "tool" and m["content"].startswith("[output of shell")]
    assert info == {"dropped_tool_outputs": len(dropped)} and dropped == [3, 5, 7, 9][:len(dropped)]
    assert view[-1] == msgs[-1] and msgs[3]["content"] == "0" * 2000        # the episode's log is untouched
    assert ContextManager(ContextConfig("drop_old_tool_outputs", budget_tokens=10 ** 6)).view(msgs, None) == (msgs, {})


def test_summarize_asks_the_policy_and_keeps_recent_turns():
    msgs = _conversation(6)
    policy = ScriptedPolicy([assistant_message("SUMMARY: listed files 6 times")])
    cm = ContextManager(ContextConfig("summarize", budget_tokens=1500, keep_recent=2))
    view, info = cm.view(msgs, policy)
    assert len(policy.calls) == 1 and policy.calls[0]["tools"] == []
    assert "turn 0" in policy.calls[0]["messages"][1]["content"]
    assert view[:2] == msgs[:2] and view[2]["content"].endswith("SUMMARY: listed files 6 times")
    assert view[3:] == msgs[-2:] and info["summarized_messages"] == len(msgs) - 4
    assert cm.view(msgs, policy)[0] == view and len(policy.calls) == 1    # fits now: no second summary


def test_summarize_in_an_episode_counts_its_tokens():
    cfg = HarnessConfig("sum", (ToolChoice("shell"), ToolChoice("submit")), "{tools}",
                        ContextConfig("summarize", budget_tokens=600, keep_recent=2))

    def policy(messages):
        if messages[0]["content"].startswith("You are summarizing"):
            return assistant_message("short summary")
        if sum(m["role"] == "assistant" for m in messages) >= 3 or any("short summary" in (m["content"] or "")
                                                                        for m in messages):
            return assistant_message(None, [tool_call("submit", {"answer": "x"})])
        return assistant_message(None, [tool_call("shell", {"command": "head -c 1500 /dev/zero | tr '\\\\0' a"})])
    sp = ScriptedPolicy(policy)
    traj = Episode(_task(), cfg, sp, sandbox_kind="none").run()
    summaries = [s["context"] for s in traj.steps if s["context"].get("summary")]
    assert summaries and summaries[0]["summary"] == "short summary" and traj.end_reason == "submitted"
    step_tokens = sum(s["usage"]["completion_tokens"] for s in traj.steps)
    assert traj.counts["completion_tokens"] == step_tokens + summaries[0]["summary_usage"]["completion_tokens"]


# --- configs, presets, sampler ----------------------------------------------------------------------------------

def test_presets_and_aliases():
    assert {"react", "coder", "terminal", "notes"} <= set(PRESETS)
    assert [t.exposed for t in PRESETS["react"].tools] == ["python", "shell", "submit"]
    assert PRESETS["coder"].context.strategy == "drop_old_tool_outputs"
    cfg = HarnessConfig("a", (ToolChoice("shell", "bash", "Run it."), ToolChoice("submit", "finish")),
                        "Use {tools}; end with {submit}.")
    tools = build_tools(cfg, _task())
    assert list(tools) == ["bash", "finish"] and tools["bash"].description == "Run it."
    assert build_tools(cfg, _task(tools=("read_file",))).keys() == {"read_file", "finish"}
    msg = [assistant_message(None, [tool_call("finish", {"answer": "a"})])]
    assert Episode(_task(), cfg, ScriptedPolicy(msg), sandbox_kind="none").run().end_reason == "submitted"


def test_config_json_round_trip_and_errors(tmp_path):
    cfg = load_harness("coder")
    path = tmp_path / "h.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert load_harness(str(path)) == cfg
    bad = [({"tools": ["shel"]}, "'tools[0].tool' = 'shel'"),
           ({"system_prompt": "{task}"}, "'system_prompt' = '{task}'"),
           ({"context": {"strategy": "forget"}}, "'context.strategy' = 'forget'"),
           ({"context": {"budget": 3}}, "'context.budget'"),
           ({"colour": 1}, "'harness config.colour'"),
           ({"tools": ["shell", {"tool": "python", "name": "shell"}]}, "'tools[1].name' = 'shell'"),
           ({"tools": ["memory"]}, "'memory_dir' = None"),
           ({"temperature": 5}, "'temperature' = 5")]
    for change, message in bad:
        with pytest.raises(HarnessConfigError, match=message.replace("[", r"\[").replace("]", r"\]")
                           .replace("{", r"\{").replace("}", r"\}")):
            HarnessConfig.from_dict({**cfg.to_dict(), **change})
    with pytest.raises(HarnessConfigError, match="neither a preset"):
        load_harness("no-such-preset")


def test_sampler_is_deterministic_and_varied(tmp_path):
    names = [a for aliases in TOOL_ALIASES.values() for a in aliases] + list(BUILTIN_TOOLS)
    assert len(names) == len(set(names)) and set(TOOL_ALIASES) == set(BUILTIN_TOOLS) == set(DESCRIPTION_VARIANTS)
    s = HarnessSampler(7, memory_dir=str(tmp_path / "m"), skills_dir=str(tmp_path / "s"))
    assert s.sample("g1") == HarnessSampler(7, memory_dir=str(tmp_path / "m"),
                                            skills_dir=str(tmp_path / "s")).sample("g1")
    draws = [s.sample(g) for g in range(40)]
    assert len({json.dumps(d.to_dict(), sort_keys=True) for d in draws}) == 40
    assert {d.context.strategy for d in draws} == {"keep_all", "drop_old_tool_outputs", "summarize"}
    assert len({t.exposed for d in draws for t in d.tools if t.tool == "shell"}) >= 3
    assert any(d.memory_dir for d in draws) and any(d.skills_dir for d in draws) and any(d.subagent for d in draws)
    assert HarnessSampler(8).sample("g1") != s.sample("g1")
    for d in draws:          # every draw runs an episode to its end
        d2 = HarnessConfig.from_dict(d.to_dict())
        sub = next(t.exposed for t in d2.tools if t.tool == "submit")
        traj = Episode(_task(), d2, ScriptedPolicy([assistant_message(None, [tool_call(sub, {"answer": "1"})])]),
                       sandbox_kind="none").run()
        assert traj.end_reason == "submitted", d2.name
