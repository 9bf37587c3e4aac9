"""`autonomous`: autonomous execution tasks (report §4.2.6): an initial state in the workspace, a goal, the tools,
a budget, a public verifier that answers `submit` with diagnostics (at most `MAX_SUBMISSIONS` times) and a hidden
verifier, stricter or on held-out scenarios, that gives the reward from the final state.

Kinds, each with randomized parameters (one instance per kind in turn):
- "fix_function": a function of the `code` problems with one injected bug, in lib.py, and test_lib.py that fails.
  Public: the test file's cases; hidden: 40 more inputs. The split is the `code` family's, by function.
- "aggregate_csv" and "organize_files": k3.env.tasks.autonomous_data (a script that must also work on held-out
  data; files to move by a rule, checked in full only by the hidden verifier). Split by a stable hash of the
  instance's parameters and data.

Every verifier runs on a fork: the public one forks the live sandbox itself, so feedback never changes it.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sys
from typing import Iterator

from k3.env.task import Budget, Task, TaskFamily, register_family
from k3.env.tasks import autonomous_data
from k3.env.tasks.code import judge_cases, reference, rules, split_problems, test_file
from k3.env.tasks.code_problems import PROBLEMS_BY_NAME, Problem
from k3.env.tasks.common import action, check_n

MAX_SUBMISSIONS = 3
BUDGET = Budget(turns=30, tokens=32768, wall_seconds=1200.0)
KINDS = ("fix_function", "aggregate_csv", "organize_files")
SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.FloorDiv: ast.Mod, ast.Mod: ast.FloorDiv, ast.And: ast.Or,
         ast.Or: ast.And}
STEP_LIMIT = 20_000  # lines a mutant may run per call (an injected bug can loop forever)


class _TooLong(Exception):
    pass


def _bounded(fn, args):
    """fn(*args), or an exception once it has run STEP_LIMIT lines (host side, on trusted generated inputs)."""
    steps = [0]

    def trace(frame, event, arg):
        steps[0] += 1
        if steps[0] > STEP_LIMIT:
            raise _TooLong
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn(*args)
    finally:
        sys.settrace(previous)


def _sites(tree: ast.AST) -> list[ast.AST]:
    """The nodes one swap can change: comparison and arithmetic operators, boolean operators, small constants."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in SWAPS:
            out.append(node)
        elif isinstance(node, (ast.BinOp, ast.BoolOp, ast.AugAssign)) and type(node.op) in SWAPS:
            out.append(node)
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 10:
            out.append(node)
    return out


def _mutate(source: str, index: int) -> str:
    tree = ast.parse(source)
    node = _sites(tree)[index]
    if isinstance(node, ast.Compare):
        node.ops[0] = SWAPS[type(node.ops[0])]()
    elif isinstance(node, ast.Constant):
        node.value += 1
    else:
        node.op = SWAPS[type(node.op)]()
    return ast.unparse(tree) + "\n"


def _outcome(fn, args):
    try:
        return ("ok", repr(_bounded(fn, args)))
    except _TooLong:
        return ("loops", None)
    except Exception as e:  # noqa: BLE001 (an exception is an outcome to compare)
        return ("raises", type(e).__name__)


def buggy_variant(problem: Problem, rng: random.Random) -> tuple[str, list[tuple], list[tuple]] | None:
    """(the buggy source, public cases, hidden cases) for a bug that two of five public cases and some hidden
    ones expose without looping forever, or None when no single swap does."""
    ref = reference(problem)
    n_sites = len(_sites(ast.parse(problem.source)))
    pool = []
    for _ in range(400):
        args = problem.gen(rng)
        if args not in pool:
            pool.append(args)
        if len(pool) == 60:
            break
    for index in rng.sample(range(n_sites), n_sites):
        ns: dict = {}
        source = _mutate(problem.source, index)
        exec(source, ns)
        outcomes = []
        for args in pool:
            outcomes.append((args, _outcome(ns[problem.name], args), _outcome(ref, args)))
            if outcomes[-1][1][0] == "loops":
                break
        if outcomes[-1][1][0] == "loops":
            continue
        bad = [a for a, m, r in outcomes if m != r]
        good = [a for a, m, r in outcomes if m == r]
        if len(bad) >= 4 and len(good) >= 3:
            public = good[:3] + bad[:2]
            return source, public, public + [a for a in pool if a not in public]
    return None


def _judge_in_fork(sandbox, problem, cases, what):
    fork = sandbox.fork()
    try:
        return judge_cases(fork, problem, cases, path="lib.py", what=what)
    finally:
        fork.close()


def fix_function_task(rng: random.Random, split: str) -> Task:
    problems = sorted(split_problems(split), key=lambda p: p.name)
    while True:
        problem = rng.choice(problems)
        got = buggy_variant(problem, rng)
        if got is not None:
            break
    source, public, hidden = got
    prompt = (f"`python3 test_lib.py` fails: lib.py's `{problem.name}` has a bug. Fix lib.py so that the function "
              f"does what its docstring says; leave the tests as they are; {rules(problem)}. `submit` runs the "
              f"tests and reports; you have {MAX_SUBMISSIONS} submissions. Hidden tests check more inputs.")
    return Task(
        id=f"autonomous/fix_function/{problem.name}/{hashlib.sha256(source.encode()).hexdigest()[:12]}",
        family="autonomous", prompt=prompt,
        image={"lib.py": f'"""A small library."""\n\n\n{source}',
               "test_lib.py": test_file(problem, public, "lib", "test_lib.py")},
        verify=lambda sandbox, answer: judge_cases(sandbox, problem, hidden, path="lib.py"),
        public_verify=lambda sandbox, answer: _judge_in_fork(sandbox, problem, public, "public tests"),
        max_submissions=MAX_SUBMISSIONS, budget=BUDGET, split=split,
        metadata={"kind": "fix_function", "problem": problem.name})


def fix_function_solution(task: Task) -> list[dict]:
    problem = PROBLEMS_BY_NAME[task.metadata["problem"]]
    return [action("shell", command="python3 test_lib.py"),
            action("write_file", path="lib.py", content=f'"""A small library."""\n\n\n{problem.source}'),
            action("shell", command="python3 test_lib.py"), action("submit", answer="fixed lib.py")]


@register_family("autonomous")
class Autonomous(TaskFamily):
    description = ("autonomous execution: a broken function, a data transformation or files to organize; a public "
                   "verifier with feedback and limited submissions, a hidden one for the reward")

    def instances(self, split: str, n: int, seed: int = 0) -> Iterator[Task]:
        check_n(split, n)
        rng = random.Random(f"autonomous/{split}/{seed}")
        for i in range(n):
            kind = KINDS[i % len(KINDS)]
            if kind == "fix_function":
                yield fix_function_task(rng, split)
            else:
                yield autonomous_data.make(kind, rng, split, MAX_SUBMISSIONS, BUDGET)

    @staticmethod
    def scripted_solution(task: Task) -> list[dict]:
        """Look, do what the goal asks, check, submit."""
        if task.metadata["kind"] == "fix_function":
            return fix_function_solution(task)
        return autonomous_data.solution(task)

