"""Every task family end to end through the episode runner: a scripted policy that plays the family's scripted
solution reaches success, one that submits without doing the work reaches failure, in the bwrap sandbox when
it is there (else unisolated)."""

import shutil

import pytest

from k3.env.client import ScriptedPolicy, assistant_message, tool_call
from k3.env.episode import Episode
from k3.env.task import get_family
from k3.env.tasks import scripted_solution

KIND = "bwrap" if shutil.which("bwrap") else "none"
HARNESS = {"name": "scripted", "tools": [{"tool": t} for t in ("shell", "python", "write_file", "submit")],
           "system_prompt": "Workspace {workspace}. Tools:\n{tools}\nSubmit with {submit}."}


WRONG_KERNEL = "def kernel(*args):\n    return args[0] * 0\n"


def first_solvable(family: str):
    for task in get_family(family).instances("test", 8, seed=0):
        try:
            return task, scripted_solution(task)
        except ValueError:       # a kernel task without a scripted solution
            continue
    raise AssertionError(f"no {family} task with a scripted solution")


def policy_of(actions):
    # score_kernel is left out: the hidden verifier scores the final kernel.py anyway
    return ScriptedPolicy([assistant_message(None, [tool_call(a["tool"], a["args"])])
                           for a in actions if a["tool"] != "score_kernel"])


@pytest.mark.parametrize("family", ["arith", "code", "autonomous", "kernel"])
def test_scripted_solution_succeeds_and_doing_nothing_fails(family):
    task, actions = first_solvable(family)
    traj = Episode(task, HARNESS, policy_of(actions), sandbox_kind=KIND).run()
    assert traj.end_reason == "submitted", (traj.end_reason, traj.error)
    assert traj.counts["tool_errors"] == 0, [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert traj.success and traj.reward > 0, traj.verdict

    # the lazy agent hands in at once (as often as the task allows); its kernel.py is wrong, since a kernel task
    # starts from a correct but slow kernel
    lazy = [{"tool": "submit", "args": {"answer": "not the answer"}}] * task.max_submissions
    if family == "kernel":
        lazy = [{"tool": "write_file", "args": {"path": "kernel.py", "content": WRONG_KERNEL}}] + lazy
    traj = Episode(task, HARNESS, policy_of(lazy), sandbox_kind=KIND).run()
    assert traj.end_reason == "submitted" and not traj.success, traj.verdict
