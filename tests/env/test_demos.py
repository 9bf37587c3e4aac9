"""`k3 env demos` (k3.env.demos): scripted solutions played through real episodes become `k3 sft` conversations;
the records are the episodes' own messages and tool specs, failures are left out and counted, the stand-ins for a
tool the harness lacks do what the tool would, and `k3 sft` trains on the file."""

import json
import math
import os
import shutil
import subprocess

import pytest

from k3.cli import main
from k3.env.client import ScriptedPolicy
from k3.env.demos import (
    _write_by_python,
    _write_by_shell,
    check_scripted,
    make_demo,
    make_demos,
    plan_demo_jobs,
    scripted_messages,
    write_demos,
)
from k3.env.episode import Episode
from k3.env.harness import build_tools
from k3.env.presets import load_harness
from k3.env.task import _FAMILIES, TaskFamily, get_family
from k3.env.tasks import scripted_solution
from k3.env.tasks.arith import Arith
from k3.posttrain.chat_data import (
    conversation_segments,
    read_chat_jsonl,
    tokenize_conversations,
)
from k3.serve.chat import DEFAULT_CHAT_TEMPLATE

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def replay(task, harness, kind):
    """The scripted episode itself, played again outside k3.env.demos: (its trajectory, its tool specs)."""
    config = load_harness(harness)
    ep = Episode(task, config, ScriptedPolicy(scripted_messages(task, build_tools(config, task))), sandbox_kind=kind)
    return ep.run(), ep.tool_specs()


@needs_bwrap
def test_arith_and_code_demos_are_sft_records_of_the_episodes_themselves(tmp_path):
    from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer

    jobs = plan_demo_jobs([("arith", 4), ("code", 2)], ["terminal", "react"], split="train", seed=3)
    report = make_demos(jobs, concurrency=3, sandbox_kind="bwrap", progress=False)
    assert report.per_family() == {"arith": (8, 8), "code": (4, 4)}, [o.reason for o in report.failures]
    path = str(tmp_path / "demos.jsonl")
    write_demos(path, report.records)
    records, bad = read_chat_jsonl(path)            # what `k3 sft --data` reads
    assert not bad and len(records) == 12
    raw = jsonl(path)
    assert [(r["task_id"], r["harness"]) for r in raw] == [(j.task.id, j.harness) for j in jobs]   # job order

    tok = K3Tokenizer(byte_level_tokenizer(512))
    for job, rec, r in zip(jobs, records, raw):
        assert r["family"] == job.task.family and r["split"] == "train"
        traj, specs = replay(job.task, job.harness, "bwrap")
        assert traj.success and rec.messages == r["messages"] == traj.messages
        assert rec.options["tools"] == r["tools"] == specs
        assert [m["role"] for m in rec.messages[:2]] == ["system", "user"] and rec.messages[1]["content"] == \
            job.task.prompt

        # exactly the scripted calls, one per assistant message, every one of them trained
        assistants = [i for i, m in enumerate(rec.messages) if m["role"] == "assistant"]
        calls = [rec.messages[i]["tool_calls"] for i in assistants]
        assert all(len(c) == 1 and rec.messages[i]["content"] is None for i, c in zip(assistants, calls))
        if job.task.family == "arith":   # the harness exposes python and submit under their own names
            assert [(c[0]["function"]["name"], json.loads(c[0]["function"]["arguments"])) for c in calls] == \
                [(a["tool"], a["args"]) for a in scripted_solution(job.task)]
        trained = {s.message for segs, on in conversation_segments(rec.messages, DEFAULT_CHAT_TEMPLATE,
                                                                   **rec.options) if on for s in segs}
        assert trained == set(assistants)
        (ids, mask), = tokenize_conversations(tok, [rec.messages], DEFAULT_CHAT_TEMPLATE, [rec.options])
        text = tok.decode(ids[mask].tolist())
        answer = json.loads(calls[-1][0]["function"]["arguments"])["answer"]
        assert answer in text and job.task.prompt not in text    # replies are labelled, the prompt is not


def test_failed_episodes_are_left_out_counted_and_reported(tmp_path, monkeypatch, capsys):
    right = Arith.scripted_solution

    def flaky(task):
        n = sum(map(ord, task.id))
        if n % 3 == 0:
            raise ValueError("no scripted solution for this one")
        actions = right(task)
        if n % 3 == 1:        # a wrong answer: the hidden verifier says no
            actions[-1] = {"tool": "submit", "args": {"answer": task.metadata["expected"] + "9"}}
        return actions

    monkeypatch.setattr(Arith, "scripted_solution", staticmethod(flaky))
    tasks = list(get_family("arith").instances("train", 12, 0))
    kinds = [sum(map(ord, t.id)) % 3 for t in tasks]
    assert {0, 1, 2} <= set(kinds)
    out = str(tmp_path / "demos.jsonl")
    assert main(["env", "demos", "--tasks", "arith:12", "--harness", "react", "--out", out, "--sandbox", "none",
                 "--no-progress"]) == 0
    cap = capsys.readouterr()
    kept = kinds.count(2)
    assert f"kept {kept}/12 (arith {kept}/12)" in cap.out
    first = next(t for t, k in zip(tasks, kinds) if k != 2)
    assert f"warning: {12 - kept} of 12 episodes kept no demonstration; the first, {first.id} (react):" in cap.err
    records = jsonl(out)
    assert [r["task_id"] for r in records] == [t.id for t, k in zip(tasks, kinds) if k == 2]

    report = make_demos(plan_demo_jobs([("arith", 12)], ["react"]), sandbox_kind="none", progress=False)
    reasons = [o.reason for o in report.failures]
    assert len(report.records) == kept and report.per_family() == {"arith": (kept, 12)}
    assert sum("no scripted solution for this one" in r for r in reasons) == kinds.count(0)
    assert sum("the hidden verifier refused it" in r for r in reasons) == kinds.count(1)

    # nothing kept: no file, an error
    monkeypatch.setattr(Arith, "scripted_solution", staticmethod(lambda task: []))
    empty = str(tmp_path / "empty.jsonl")
    assert main(["env", "demos", "--tasks", "arith:2", "--out", empty, "--sandbox", "none", "--no-progress"]) == 1
    assert "no episode succeeded" in capsys.readouterr().err and not os.path.exists(empty)


def test_bad_family_names_give_clear_errors(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "d.jsonl")
    assert main(["env", "demos", "--tasks", "nope:2", "--out", out, "--sandbox", "none"]) == 2
    assert "unknown task family 'nope'" in capsys.readouterr().err

    class Unscripted(TaskFamily):
        name = "unscripted"

        def instances(self, split, n, seed=0):
            return iter(())

    monkeypatch.setitem(_FAMILIES, "unscripted", Unscripted)
    with pytest.raises(ValueError, match="task family unscripted has no scripted_solution"):
        check_scripted(["arith", "unscripted"])
    assert main(["env", "demos", "--tasks", "arith:1", "unscripted:1", "--out", out, "--sandbox", "none"]) == 2
    assert "unscripted has no scripted_solution" in capsys.readouterr().err and not os.path.exists(out)


def test_stand_ins_for_tools_the_harness_lacks(tmp_path):
    task = next(iter(get_family("code").instances("train", 1, 0)))
    terminal = load_harness("terminal")           # shell and submit: no write_file
    msgs = scripted_messages(task, build_tools(terminal, task))
    names = [m["tool_calls"][0]["function"]["name"] for m in msgs]
    assert names == ["shell", "shell", "submit"]
    assert json.loads(msgs[0]["tool_calls"][0]["function"]["arguments"])["command"].startswith("cat > solution.py")
    outcome = make_demo(task, terminal, sandbox_kind="none")
    assert outcome.kept, outcome.reason

    outcome = make_demo(task, terminal, sandbox_kind="none", stand_ins=False)
    assert not outcome.kept and "calls 'write_file', which the harness does not offer" in outcome.reason

    # the shell and Python stand-ins for write_file write exactly the content, whatever it holds
    for i, content in enumerate(["a 'quoted' $HOME `x`\nEOF\nlast\n", "no newline at the end \\n 'q'", ""]):
        path = f"sub{i}/f.txt"
        subprocess.run(["/bin/sh", "-c", _write_by_shell(path, content)["command"]], cwd=tmp_path, check=True)
        assert (tmp_path / path).read_text() == content
        path = f"py{i}/f.txt"
        subprocess.run(["python3", "-c", _write_by_python(path, content)["code"]], cwd=tmp_path, check=True)
        assert (tmp_path / path).read_text() == content


def test_k3_sft_trains_on_the_demos(tmp_path, capsys):
    from helpers import one_torch_thread, tiny_chat_checkpoint

    ckpt = tmp_path / "tiny"
    tiny_chat_checkpoint(ckpt)
    data = str(tmp_path / "demos.jsonl")
    assert main(["env", "demos", "--tasks", "arith:6", "--harness", "terminal", "--out", data, "--sandbox", "none",
                 "--no-progress"]) == 0
    assert "kept 6/6 (arith 6/6)" in capsys.readouterr().out
    out = str(tmp_path / "sft")
    with one_torch_thread():     # a tiny model: more threads only contend on a busy machine (10x slower)
        assert main(["sft", "--ckpt", str(ckpt), "--data", data, "--out", out, "--max-steps", "2", "--seq-len",
                     "2048", "--batch-tokens", "2048", "--device", "cpu", "--no-progress"]) == 0
    metrics = jsonl(os.path.join(out, "metrics.jsonl"))
    losses = [m["loss"] for m in metrics if m.get("loss") is not None]
    assert len(losses) >= 1 and all(math.isfinite(loss) and loss > 0 for loss in losses)
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-0000002"))
