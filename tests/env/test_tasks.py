"""The verifiable task families (k3.env.tasks): deterministic instances and disjoint splits, scripted solutions
that pass the hidden verifier and wrong ones that fail, verdicts taken on forks, hidden material invisible from
inside the sandbox, the public verifier's feedback and its submission limit, and the refused copy hack."""

import importlib.util
import inspect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import pytest

from k3.env.sandbox import create_sandbox
from k3.env.task import get_family
from k3.env.tasks import scripted_solution
from k3.env.tasks.arith import normalize
from k3.env.tasks.code_problems import PROBLEMS
from k3.env.toolbox import BUILTIN_TOOLS
from k3.env.tools import ToolContext, call_tool

KINDS = ["none"] + (["bwrap"] if shutil.which("bwrap") and importlib.util.find_spec("k3.env.bwrap") else [])


def sandbox_for(task, kind):
    """A sandbox whose workspace starts as the task's image."""
    with tempfile.TemporaryDirectory() as image:
        for rel, content in task.image.items():
            path = os.path.join(image, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        return create_sandbox(kind, image)


def play(sandbox, task, actions=None):
    """Carry out a task's scripted actions (or `actions`) with the real tools; returns the submitted answer. A
    command may fail (a script looks before it fixes); a tool call may not."""
    ctx = ToolContext(sandbox=sandbox, task=task)
    for a in scripted_solution(task) if actions is None else actions:
        out = call_tool(BUILTIN_TOOLS, ctx, a["tool"], a["args"], max_output_chars=100_000)
        assert not out.error, (a, out.text)
    return ctx.answer


def judge(sandbox, task, answer):
    """The hidden verdict, taken on a fork (as the episode does), the fork closed after."""
    fork = sandbox.fork()
    try:
        return task.verify(fork, answer)
    finally:
        fork.close()


@pytest.mark.parametrize("family", ["arith", "code"])
def test_instances_are_deterministic_and_splits_disjoint(family):
    fam = get_family(family)
    a = [(t.id, t.prompt, t.image) for t in fam.instances("train", 12, seed=3)]
    assert a == [(t.id, t.prompt, t.image) for t in fam.instances("train", 12, seed=3)]
    assert a != [(t.id, t.prompt, t.image) for t in fam.instances("train", 12, seed=4)]
    train = list(fam.instances("train", 60, seed=0))
    test = list(fam.instances("test", 60, seed=0))
    assert len(train) == len(test) == 60
    if family == "code":  # a function is never in both splits
        assert not {t.metadata["problem"] for t in train} & {t.metadata["problem"] for t in test}
    else:
        assert not {t.prompt for t in train} & {t.prompt for t in test}
    with pytest.raises(ValueError, match="split"):
        list(fam.instances("dev", 1))


DIGEST = """
import hashlib, json
from k3.env.task import get_family
h = hashlib.sha256()
for family in ("arith", "code", "autonomous"):
    for split in ("train", "test"):
        for t in get_family(family).instances(split, 6, seed=2):
            image = {k: v if isinstance(v, str) else v.hex() for k, v in t.image.items()}
            h.update(json.dumps([t.id, t.prompt, image, repr(t.metadata)]).encode())
print(h.hexdigest())
"""


def test_instances_are_the_same_in_every_process():
    """No dependence on str hashing (randomized per process) or on anything but (split, n, seed)."""
    digests = {subprocess.run([sys.executable, "-c", DIGEST], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(s)}).stdout for s in (1, 2)}
    assert len(digests) == 1 and len(digests.pop().strip()) == 64


def test_arith_answers_are_normalized_and_checked():
    fam = get_family("arith")
    tasks = list(fam.instances("train", 30, seed=1))
    assert len({t.metadata["kind"] for t in tasks}) >= 6
    assert all(len(t.prompt) <= 64 for t in tasks)
    t = next(t for t in tasks if t.metadata["kind"] in ("mul_add", "mul_sub"))
    want = t.metadata["expected"]
    assert t.verify(None, f" {int(want):,}. ").success
    assert not t.verify(None, str(int(want) + 1)).success
    assert t.verify(None, None).reward == 0.0
    assert normalize("`Abc`.") == "abc"


@pytest.mark.parametrize("kind", KINDS)
def test_arith_scripted_solution_runs_and_passes(kind):
    task = next(get_family("arith").instances("test", 1, seed=0))
    with sandbox_for(task, kind) as sb:
        run = scripted_solution(task)[0]
        out = call_tool(BUILTIN_TOOLS, ToolContext(sandbox=sb, task=task), run["tool"], run["args"], 1000)
        assert task.metadata["expected"] in out.text  # what the tool printed is the answer
        assert judge(sb, task, play(sb, task)).reward == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_code_hidden_verifier(kind):
    task = next(get_family("code").instances("train", 1, seed=0))
    name = task.metadata["problem"]
    with sandbox_for(task, kind) as sb:
        before = sb.read_file("solution.py")
        stub = judge(sb, task, None)
        assert not stub.success and stub.data["pass_fraction"] == 0.0
        assert sb.read_file("solution.py") == before and sb.list_files() == ["solution.py", "test_public.py"]
        assert not sb.exec("python3 test_public.py").ok
        answer = play(sb, task)
        good = judge(sb, task, answer)
        assert good.success and good.reward == 1.0 and good.data["pass_fraction"] == 1.0, good.details
        # right on the public examples only: the hidden tests catch it
        cases = sb.read_file("test_public.py").decode().split("CASES = [")[1].split("]\n\n")[0]
        sb.write_file("solution.py", f"CASES = [{cases}]\n"
                      f"def {name}(*args):\n    return {{repr(a): w for a, w in CASES}}[repr(args)]\n")
        assert sb.exec("python3 test_public.py").ok
        memo = judge(sb, task, answer)
        assert not memo.success and 0.0 < memo.data["pass_fraction"] < 1.0
        assert [f for f in sb.list_files() if "__pycache__" not in f] == ["solution.py", "test_public.py"]
        # a correct solution that prints far more than a command's captured output is still judged
        sb.write_file("solution.py", "print('x' * 200_000)\n" + scripted_solution(task)[0]["args"]["content"])
        assert judge(sb, task, answer).success


@pytest.mark.parametrize("kind", KINDS)
def test_code_hidden_tests_are_not_visible_in_the_sandbox(kind):
    task = next(get_family("code").instances("train", 1, seed=0))
    with sandbox_for(task, kind) as sb:
        play(sb, task)
        fork = sb.fork()  # a verification in progress, its hidden cases written into the fork
        try:
            assert task.verify(fork, "solution.py").success
            assert any(".k3_check" in f for f in fork.list_files())
            assert not any(".k3_check" in f for f in sb.list_files())
            # "none" sees the whole host: it can only be searched in its workspace; bwrap sees its own world
            where = "/" if kind == "bwrap" else "."
            found = sb.exec(f"find {where} -name .k3_check -not -path '/proc/*' 2>/dev/null", timeout=60)
            assert found.stdout.strip() == ""
        finally:
            fork.close()


def test_code_refuses_the_original_and_says_why():
    fam = get_family("code")
    task = next(t for t in fam.instances("train", 46) if t.metadata["problem"] == "median")
    with sandbox_for(task, "none") as sb:
        sb.write_file("solution.py", "from statistics import median\n")
        v = judge(sb, task, None)
        assert not v.success and "refused" in v.details and "statistics" in v.details
        sb.write_file("solution.py", "import k3.env.tasks.code_problems as p\nmedian = None\n")
        assert "'k3" in judge(sb, task, None).details
        sb.write_file("solution.py", "def median(v):\n    return __import__('stat' + 'istics').median(v)\n")
        assert "__import__" in judge(sb, task, None).details
    task = next(t for t in fam.instances("train", 46) if t.metadata["problem"] == "harmonic_mean")
    with sandbox_for(task, "none") as sb:
        sb.write_file("solution.py", inspect.getsource(statistics.harmonic_mean))
        v = judge(sb, task, None)
        assert not v.success and "copy of statistics.harmonic_mean" in v.details


def test_code_problems_are_many_and_consistent():
    assert len(PROBLEMS) >= 50 and len({p.name for p in PROBLEMS}) == len(PROBLEMS)
    fam = get_family("code")
    n_test = sum(1 for _ in {t.metadata["problem"] for t in fam.instances("test", 64)})
    assert 10 <= n_test <= 25


def test_every_code_problem_reference_passes_its_hidden_tests():
    fam = get_family("code")
    tasks = list(fam.instances("train", 46)) + list(fam.instances("test", 18))
    assert len({t.metadata["problem"] for t in tasks}) == len(PROBLEMS)
    with create_sandbox("none") as sb:
        for task in tasks:
            sb.write_file("solution.py", scripted_solution(task)[0]["args"]["content"])
            v = task.verify(sb, "solution.py")
            assert v.success and v.data["pass_fraction"] == 1.0, (task.id, v.details)


def state(sb):
    return {f: sb.read_file(f) for f in sb.list_files() if "__pycache__" not in f}


def autonomous_task(kind, split="train"):
    return next(t for t in get_family("autonomous").instances(split, 6, seed=0) if t.metadata["kind"] == kind)


def test_autonomous_submit_gives_feedback_within_the_limit():
    task = autonomous_task("aggregate_csv")
    with sandbox_for(task, "none") as sb:
        ctx = ToolContext(sandbox=sb, task=task)
        texts = [call_tool(BUILTIN_TOOLS, ctx, "submit", {"answer": "try"}, 10_000) for _ in range(3)]
        assert all(not t.error and "aggregate.py does not exist" in t.text for t in texts)
        assert ctx.finished and len(ctx.public_verdicts) == task.max_submissions == 3
        extra = call_tool(BUILTIN_TOOLS, ctx, "submit", {"answer": "again"}, 10_000)
        assert extra.error and "no submissions left" in extra.text
        assert sb.list_files() == ["data.csv"]


def test_autonomous_instances():
    fam = get_family("autonomous")
    train, test = list(fam.instances("train", 30)), list(fam.instances("test", 30))
    assert [t.id for t in train] == [t.id for t in fam.instances("train", 30)]
    assert {t.metadata["kind"] for t in train} == {"fix_function", "aggregate_csv", "organize_files"}
    assert not {t.id for t in train} & {t.id for t in test}
    fixes = lambda ts: {t.metadata["problem"] for t in ts if t.metadata["kind"] == "fix_function"}  # noqa: E731
    assert not fixes(train) & fixes(test)
    assert all(t.max_submissions == 3 and t.public_verify is not None for t in train)


# a solution right on what the public verifier sees, wrong on what only the hidden one checks; made in the initial
# state from the state a correct solution reached
OVERFIT = {
    "fix_function": lambda task, sb, solved: sb.write_file("lib.py", solved["test_lib.py"].decode().split(
        "failed = 0")[0].replace(f"from lib import {task.metadata['problem']}", "") +
        f"def {task.metadata['problem']}(*args):\n    return {{repr(a): w for a, w in CASES}}[repr(args)]\n"),
    "aggregate_csv": lambda task, sb, solved: sb.write_file(
        "aggregate.py", f"open('out.csv', 'w').write({solved['out.csv'].decode()!r})\n"),
    "organize_files": lambda task, sb, solved: [sb.write_file(path, data) for path, data in solved.items()],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("task_kind", ["fix_function", "aggregate_csv", "organize_files"])
def test_autonomous_public_feedback_and_hidden_verdict(task_kind, kind):
    task = autonomous_task(task_kind)
    with sandbox_for(task, kind) as sb:
        initial = sb.snapshot()
        first = task.public_verify(sb, None)
        assert not first.success and first.reward < 1.0 and first.details
        assert ("failures" in first.details or "missing" in first.details or "does not exist" in first.details)
        assert not judge(sb, task, None).success
        answer = play(sb, task)
        before = state(sb)
        public = task.public_verify(sb, answer)
        assert public.success and public.reward == 1.0, public.details
        hidden = judge(sb, task, answer)
        assert hidden.success and hidden.reward == 1.0, hidden.details
        assert state(sb) == before  # both verdicts left the sandbox as it was
        sb.restore(initial)
        OVERFIT[task_kind](task, sb, before)
        assert task.public_verify(sb, answer).success
        overfit = judge(sb, task, answer)
        assert not overfit.success and overfit.reward == 0.0 and overfit.data["pass_fraction"] < 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_autonomous_held_out_data_never_enters_the_sandbox(kind):
    task = autonomous_task("aggregate_csv")
    with sandbox_for(task, kind) as sb:
        answer = play(sb, task)
        task.public_verify(sb, answer)
        assert judge(sb, task, answer).success
        where = "/workspace /tmp" if kind == "bwrap" else "."
        assert sb.exec(f"grep -rl 'fig, dried' {where} 2>/dev/null").stdout.strip() == ""


def test_kernel_instances():
    from k3.env.tasks.kernel import kernel_tasks

    fam = get_family("kernel")
    train, test = list(fam.instances("train", 20)), list(fam.instances("test", 4))
    names = lambda ts: {t.metadata["kernel_task"] for t in ts}  # noqa: E731
    assert names(train) | names(test) == set(kernel_tasks()) and not names(train) & names(test)
    assert [t.id for t in train] == [t.id for t in fam.instances("train", 20)]
    assert all({"kernel.py", "TASK.md", "reference.py"} <= set(t.image) for t in train + test)
    stub = next(t for t in train + test if not t.metadata["starts_correct"])
    assert "NotImplementedError" in stub.image["kernel.py"]
    with pytest.raises(ValueError, match="no scripted solution"):
        scripted_solution(stub)
    with pytest.raises(ValueError, match="device"):
        type(fam)(device="tpu")


def test_kernel_verdict_is_the_kernel_reward():
    from k3.kernel_reward.examples import source

    task = next(t for t in get_family("kernel").instances("train", 20) if t.metadata["kernel_task"] == "rms_norm")
    with sandbox_for(task, "none") as sb:
        sb.write_file("kernel.py", source("wrong"))
        wrong = judge(sb, task, None)
        assert not wrong.success and wrong.reward == 0.0 and "wrong result" in wrong.details
        answer = play(sb, task, [a for a in scripted_solution(task) if a["tool"] != "score_kernel"])  # scored below
        good = judge(sb, task, answer)
        assert good.success and 0.0 < good.reward <= 1.0 and good.data["hacks"] == [], good.details
        assert sb.read_file("kernel.py").decode() == source("rms_norm_torch")
