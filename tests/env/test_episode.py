"""The episode runner: scripted policies reach success and failure, malformed calls become tool errors, every
budget ends an episode with its reason, a policy failure ends it with "error", and trajectories round-trip."""

import json
import os
import shutil
import time

import pytest

from k3.env.client import PolicyError, ScriptedPolicy, assistant_message, tool_call
from k3.env.episode import Episode
from k3.env.sandbox import SandboxError
from k3.env.task import Budget, Task, Verdict
from k3.env.tools import ERROR_PREFIX
from k3.env.trajectory import Trajectory, TrajectoryError, append_jsonl, read_jsonl


def _kinds():
    kinds = ["none"]
    if shutil.which("bwrap") and os.path.exists(os.path.join(os.path.dirname(__file__), "../../k3/env/bwrap.py")):
        kinds.append("bwrap")
    return kinds


@pytest.fixture(params=_kinds())
def kind(request):
    return request.param


def _verify_42(sandbox, answer):
    try:
        got = sandbox.read_file("answer.txt").decode().strip()
    except SandboxError:
        return Verdict(0.0, False, "no answer.txt")
    return Verdict(float(got == "42"), got == "42", f"answer.txt holds {got!r}")


def answer_task(**kw) -> Task:
    return Task(id="t42", family="test-answer", prompt="Write 42 to answer.txt, then submit.", verify=_verify_42,
                image={"README": "write the answer here\n"}, split="test", **kw)


def solve(value: str):
    return [assistant_message("I will write it.", [tool_call("shell", {"command": f"echo {value} > answer.txt"})],
                              reasoning="The task asks for a file."),
            assistant_message(None, [tool_call("submit", {"answer": value})])]


def test_scripted_episode_succeeds_and_is_recorded(kind):
    policy = ScriptedPolicy(solve("42"))
    traj = Episode(answer_task(), "react", policy, sandbox_kind=kind).run()
    assert traj.end_reason == "submitted" and traj.answer == "42"
    assert traj.success and traj.reward == 1.0
    assert traj.counts["turns"] == 2 and traj.counts["tool_calls"] == 2 and traj.counts["tool_errors"] == 0
    roles = [m["role"] for m in traj.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert traj.messages[2]["reasoning_content"] == "The task asks for a file."
    assert traj.messages[3]["tool_call_id"] == traj.messages[2]["tool_calls"][0]["id"]
    assert traj.messages[3]["content"].startswith("exit code 0")
    assert traj.split == "test" and traj.harness == "react"
    # the policy saw the tool specs of the react preset
    assert {t["function"]["name"] for t in policy.calls[0]["tools"]} == {"python", "shell", "submit"}


def test_wrong_answer_fails_and_the_verifier_judges_a_fork():
    traj = Episode(answer_task(), "react", ScriptedPolicy(solve("41")), sandbox_kind="none").run()
    assert traj.end_reason == "submitted" and traj.answer == "41"
    assert not traj.success and traj.reward == 0.0 and "'41'" in traj.verdict["details"]

    seen = {}

    def verify(sandbox, answer):
        seen["workspace"], seen["file"], seen["answer"] = sandbox.workspace, sandbox.read_file("answer.txt"), answer
        return Verdict(0.0, False, "judged")
    ep = Episode(Task(id="f", family="x", prompt="p", verify=verify), "react", ScriptedPolicy(solve("41")),
                 sandbox_kind="none")
    ep.run()
    assert seen["file"] == b"41\n" and seen["answer"] == "41"
    assert seen["workspace"] != ep.sandbox.workspace
    assert not os.path.exists(ep.sandbox.workspace) and not os.path.exists(seen["workspace"])  # all closed


def test_policy_extras_are_kept_per_step():
    class WithExtras(ScriptedPolicy):
        def complete(self, messages, tools, **kw):
            c = super().complete(messages, tools, **kw)
            c.extras = {"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3]}
            return c
    traj = Episode(answer_task(), "react", WithExtras(solve("42")), sandbox_kind="none").run()
    assert traj.steps[0]["extras"]["token_ids"] == [1, 2, 3] and traj.steps[1]["extras"]["logprobs"][2] == -0.3
    assert traj.steps[0]["tool_calls"][0]["name"] == "shell" and traj.steps[0]["policy_s"] >= 0


def test_final_message_without_tool_calls_is_the_answer():
    task = Task(id="q", family="x", prompt="What is 6*7?",
                verify=lambda sb, a: Verdict(float(a == "42"), a == "42"))
    traj = Episode(task, "terminal", ScriptedPolicy([assistant_message("42")]), sandbox_kind="none").run()
    assert traj.end_reason == "answered" and traj.answer == "42" and traj.success


def test_malformed_calls_become_tool_errors_and_the_episode_goes_on():
    script = [assistant_message(None, [tool_call("shell", "{not json"),
                                       tool_call("no_such_tool", {}),
                                       tool_call("shell", {"cmd": "ls"}),
                                       tool_call("shell", {"command": 3}),
                                       tool_call("shell", "[1, 2]")]),
              *solve("42")]
    traj = Episode(answer_task(), "react", ScriptedPolicy(script), sandbox_kind="none").run()
    assert traj.success and traj.counts["tool_errors"] == 5 and traj.counts["tool_calls"] == 7
    errors = [m["content"] for m in traj.messages[3:8]]
    assert all(e.startswith(ERROR_PREFIX) for e in errors)
    assert "not valid JSON" in errors[0]
    assert "unknown tool 'no_such_tool'" in errors[1] and "shell" in errors[1]
    assert "missing required argument 'command'" in errors[2] and "unexpected argument 'cmd'" in errors[2]
    assert "argument 'command' must be string, got int 3" in errors[3]
    assert "must be a JSON object, got list" in errors[4]
    ids = [c["id"] for c in traj.messages[2]["tool_calls"]]
    assert [m["tool_call_id"] for m in traj.messages[3:8]] == ids and len(set(ids)) == 5


def test_parallel_calls_run_in_order_and_a_submission_stops_the_rest():
    msg = assistant_message(None, [tool_call("shell", {"command": "echo 4 > answer.txt"}),
                                   tool_call("shell", {"command": "echo 42 > answer.txt"}),
                                   tool_call("submit", {"answer": "done"}),
                                   tool_call("shell", {"command": "echo 0 > answer.txt"})])
    traj = Episode(answer_task(), "react", ScriptedPolicy([msg]), sandbox_kind="none").run()
    assert traj.success and traj.end_reason == "submitted"
    assert traj.messages[-1]["content"].startswith("not run")
    assert traj.counts["tool_calls"] == 3


def _looping(n_chars=10):
    return lambda messages: assistant_message("x" * n_chars, [tool_call("shell", {"command": "true"})])


def test_turn_budget():
    traj = Episode(answer_task(budget=Budget(turns=3)), "react", ScriptedPolicy(_looping()), sandbox_kind="none").run()
    assert traj.end_reason == "max_turns" and traj.counts["turns"] == 3 and not traj.success


def test_token_budget():
    policy = ScriptedPolicy(_looping(400))      # about 100+ tokens a turn
    traj = Episode(answer_task(budget=Budget(turns=100, tokens=250)), "react", policy, sandbox_kind="none").run()
    assert traj.end_reason == "max_tokens" and traj.counts["completion_tokens"] >= 250
    assert traj.counts["turns"] < 5
    # each request asks for no more than what is left of the budget
    assert policy.calls[1]["max_tokens"] == 250 - traj.steps[0]["usage"]["completion_tokens"]


def test_wall_budget_ends_a_long_command():
    task = answer_task(budget=Budget(turns=100, wall_seconds=1.0))
    policy = ScriptedPolicy(lambda m: assistant_message(None, [tool_call("shell", {"command": "sleep 30"})]))
    t = time.monotonic()
    traj = Episode(task, "react", policy, sandbox_kind="none").run()
    assert traj.end_reason == "timeout" and time.monotonic() - t < 10
    assert "timed out" in traj.messages[3]["content"]


def test_policy_failure_ends_with_error():
    def down(messages):
        raise PolicyError("connection refused")
    traj = Episode(answer_task(), "react", ScriptedPolicy(down), sandbox_kind="none").run()
    assert traj.end_reason == "error" and "connection refused" in traj.error
    assert traj.verdict is not None and not traj.success          # the verifier still judged the sandbox


def test_sandbox_failure_ends_with_error():
    traj = Episode(answer_task(), "react", ScriptedPolicy([]), sandbox_kind="no-such-kind").run()
    assert traj.end_reason == "error" and "sandbox kind" in traj.error and traj.verdict is None


def test_public_verifier_gives_feedback_within_max_submissions():
    def public(sandbox, answer):
        return Verdict(float(answer == "42"), answer == "42", f"{answer} is {'right' if answer == '42' else 'wrong'}")
    task = answer_task(public_verify=public, max_submissions=2)
    script = [assistant_message(None, [tool_call("submit", {"answer": "41"})]),
              assistant_message(None, [tool_call("shell", {"command": "echo 42 > answer.txt"}),
                                       tool_call("submit", {"answer": "42"})])]
    traj = Episode(task, "react", ScriptedPolicy(script), sandbox_kind="none").run()
    assert "41 is wrong" in traj.messages[3]["content"] and "1 submission(s) left" in traj.messages[3]["content"]
    assert traj.end_reason == "submitted" and traj.counts["submissions"] == 2 and traj.success
    assert [v["success"] for v in traj.public_verdicts] == [False, True]


def test_trajectory_jsonl_round_trip(tmp_path):
    policy = ScriptedPolicy(solve("42"))
    traj = Episode(answer_task(), "coder", policy, sandbox_kind="none").run()
    path = str(tmp_path / "out" / "traj.jsonl")
    append_jsonl(path, traj)
    append_jsonl(path, traj)
    back = read_jsonl(path)
    assert len(back) == 2 and back[0] == traj
    assert back[0].harness_config["context"]["strategy"] == "drop_old_tool_outputs"
    assert back[0].steps[0]["usage"]["completion_tokens"] > 0
    with open(path, "a") as f:
        f.write(json.dumps({**traj.to_dict(), "end_reason": "bored"}) + "\n")
    with pytest.raises(TrajectoryError, match=r"traj.jsonl:3: .*end_reason 'bored'"):
        read_jsonl(path)
    with pytest.raises(TrajectoryError, match="field 'counts' is missing"):
        Trajectory.from_dict({k: v for k, v in traj.to_dict().items() if k != "counts"})


def test_driven_one_step_at_a_time():
    policy = ScriptedPolicy([])
    ep = Episode(answer_task(), "terminal", policy, sandbox_kind="none")
    first = ep.reset()
    assert [m["role"] for m in first] == ["system", "user"] and "shell" in first[0]["content"]
    assert ep.observation() == first and not ep.done
    results = ep.step(assistant_message(None, [tool_call("shell", {"command": "echo 42 > answer.txt"}, id="a")]))
    assert [(m["role"], m["tool_call_id"]) for m in results] == [("tool", "a")] and not ep.done
    ep.step({"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "submit", "arguments": {"answer": "42"}}}]})
    assert ep.done and ep.end_reason == "submitted"
    with pytest.raises(RuntimeError, match="running episode"):
        ep.step(assistant_message("more"))
    traj = ep.finish()
    assert traj.success and traj.messages[-2]["tool_calls"][0]["id"] == "call_2_0" and policy.calls == []
