"""`k3 env run`'s machinery (k3.env.run, k3.env.cli): task specs, jobs, concurrent episodes, the summary table,
resuming, and the errors a user sees."""

import json
import os

import pytest

from k3.env.client import ScriptedPolicy, assistant_message, tool_call
from k3.env.run import (SUMMARY_JSON, SUMMARY_MD, TRAJECTORIES, format_table, parse_task_specs, plan_jobs,
                        run_jobs)
from k3.env.trajectory import read_jsonl


def oracle(jobs, wrong_every: int = 0):
    """A policy that submits each arith task's expected answer (a wrong one for every `wrong_every`-th task)."""
    answers = {}
    for i, j in enumerate(jobs):
        expected = j.task.metadata["expected"]
        answers[j.task.prompt] = expected + "0" if wrong_every and i % wrong_every == 0 else expected

    def play(messages):
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        return assistant_message(None, [tool_call("submit", {"answer": answers[prompt]})])

    return ScriptedPolicy(play)


def test_parse_task_specs():
    assert parse_task_specs(["arith:3", "code"]) == [("arith", 3), ("code", 10)]
    assert parse_task_specs(["arith:2,code:1"]) == [("arith", 2), ("code", 1)]
    with pytest.raises(ValueError, match="unknown task family 'nope'"):
        parse_task_specs(["nope:2"])
    with pytest.raises(ValueError, match="positive integer"):
        parse_task_specs(["arith:0"])
    with pytest.raises(ValueError, match="positive integer"):
        parse_task_specs(["arith:x"])


def test_plan_jobs_runs_the_same_instances_with_each_harness():
    jobs = plan_jobs([("arith", 3)], ["react", "terminal"], split="test", seed=1)
    assert len(jobs) == 6
    react = [j.task.id for j in jobs if j.harness == "react"]
    assert react == [j.task.id for j in jobs if j.harness == "terminal"] and len(set(react)) == 3
    with pytest.raises(ValueError, match="split"):
        plan_jobs([("arith", 1)], ["react"], split="dev")
    with pytest.raises(ValueError, match="neither a preset"):
        plan_jobs([("arith", 1)], ["no-such-harness"])
    with pytest.raises(ValueError, match="share a name"):
        plan_jobs([("arith", 1)], ["react", "react"])


def test_run_writes_trajectories_and_a_summary_per_family_and_harness(tmp_path):
    jobs = plan_jobs([("arith", 4)], ["react", "terminal"], split="test")
    summary = run_jobs(jobs, oracle(jobs, wrong_every=4), str(tmp_path), concurrency=3, sandbox_kind="none",
                       progress=False)
    trajs = read_jsonl(str(tmp_path / TRAJECTORIES))
    assert len(trajs) == 8 and {t.harness for t in trajs} == {"react", "terminal"}
    assert all(t.end_reason == "submitted" for t in trajs)
    rows = {(r["family"], r["harness"]): r for r in summary["rows"]}
    # wrong_every=4 makes job 0 (react) and job 4 (terminal) wrong: 3 of 4 right in each row
    assert rows[("arith", "react")]["success_rate"] == pytest.approx(0.75)
    assert rows[("arith", "terminal")]["success_rate"] == pytest.approx(0.75)
    assert summary["total"]["episodes"] == 8 and summary["total"]["harness_errors"] == 0
    assert summary["total"]["mean_turns"] == pytest.approx(1.0)
    assert json.loads((tmp_path / SUMMARY_JSON).read_text())["total"]["success_rate"] == pytest.approx(0.75)
    table = (tmp_path / SUMMARY_MD).read_text()
    assert "| arith | react | 4 | 75.0% |" in table and table == format_table(summary) + "\n"


def test_an_existing_run_is_refused_unless_resumed_and_resume_runs_only_what_is_missing(tmp_path):
    jobs = plan_jobs([("arith", 3)], ["react"], split="test")
    run_jobs(jobs[:2], oracle(jobs), str(tmp_path), concurrency=2, sandbox_kind="none", progress=False)
    with pytest.raises(ValueError, match="--resume"):
        run_jobs(jobs, oracle(jobs), str(tmp_path), sandbox_kind="none", progress=False)
    seen = []
    policy = oracle(jobs)
    inner = policy.complete

    def counting(messages, tools, **kw):
        seen.append(next(m["content"] for m in messages if m["role"] == "user"))
        return inner(messages, tools, **kw)

    policy.complete = counting
    summary = run_jobs(jobs, policy, str(tmp_path), sandbox_kind="none", resume=True, progress=False)
    assert seen == [jobs[2].task.prompt]       # only the missing episode ran
    assert summary["total"]["episodes"] == 3 and summary["total"]["success_rate"] == 1.0


def test_a_failing_policy_is_a_harness_error_not_a_crash(tmp_path):
    jobs = plan_jobs([("arith", 2)], ["react"], split="test")

    def down(messages):
        raise ConnectionError("the server is down")

    summary = run_jobs(jobs, ScriptedPolicy(down), str(tmp_path), sandbox_kind="none", progress=False)
    assert summary["total"]["harness_errors"] == 2 and summary["total"]["success_rate"] == 0.0
    assert all("the server is down" in t.error for t in read_jsonl(str(tmp_path / TRAJECTORIES)))


def test_cli_list_and_argument_errors(capsys, tmp_path):
    from k3.cli import main

    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    assert "arith" in out and "code" in out and "react" in out and "coder" in out
    assert main(["env", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"arith", "code", "autonomous"} <= set(listed["families"]) and "react" in listed["harnesses"]
    assert main(["env", "run", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--tasks", "nope",
                 "--out", str(tmp_path / "o")]) == 2
    assert "unknown task family 'nope'" in capsys.readouterr().err
    assert main(["env", "run", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--tasks", "arith:1",
                 "--concurrency", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / TRAJECTORIES)
