"""`code`: implement a function from its signature and docstring (report §4.2.3), the agentic form of the
docstring-to-code data (k3.data.sft_from_source).

The workspace holds `solution.py`, a stub (signature, docstring with three examples, `raise NotImplementedError`),
and `test_public.py`, which checks those examples. The hidden verifier copies a runner, the examples and 40 further
inputs into a fork of the final sandbox, runs the solution on them there (isolated Python, a time limit), and
compares the outputs on the host with the reference's, which never enter the sandbox. Reward 1 when every hidden
case passes; the pass fraction is in the verdict's data.

A solution that imports the function it should write (the standard-library module it mirrors, or k3) or copies
its standard-library source is refused: the static check reads the source, and the runner also makes those
modules unimportable. A problem belongs to one split for good (a stable hash of its name); n beyond a split's
problems repeats them as new variants (other examples and hidden inputs).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import textwrap
from typing import Iterator

from k3.env.sandbox import SandboxError
from k3.env.task import Budget, Task, TaskFamily, Verdict, register_family
from k3.env.tasks.code_problems import PROBLEMS, PROBLEMS_BY_NAME, Problem
from k3.env.tasks.common import action, check_n, describe_failure, run_check, split_of

TEST_FRACTION = 0.25
PUBLIC_CASES = 3
HIDDEN_CASES = 40
CHECK_SECONDS = 30.0
ALWAYS_FORBIDDEN = ("k3", "importlib", "subprocess", "ctypes", "multiprocessing", "runpy")
FORBIDDEN_CALLS = ("__import__", "exec", "eval")

# The canonical form of a value, the same on the host and in the runner: JSON with the type kept, so (1, 2) is not
# [1, 2] and True is not 1; floats are compared with a tolerance (`same`).
CANON = '''
def canon(x):
    if isinstance(x, float):
        return ["float", x if x == x and abs(x) != float("inf") else repr(x)]
    if x is None or isinstance(x, (bool, int, str)):
        return [type(x).__name__, x]
    if isinstance(x, (bytes, bytearray)):
        return [type(x).__name__, x.hex()]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [canon(v) for v in x]]
    if isinstance(x, (set, frozenset)):
        return [type(x).__name__, sorted((canon(v) for v in x), key=repr)]
    if isinstance(x, dict):
        return ["dict", sorted(([canon(k), canon(v)] for k, v in x.items()), key=repr)]
    return ["repr", repr(x)]
'''
_ns: dict = {}
exec(CANON, _ns)
canon = _ns["canon"]

# The hidden-test runner, run in the fork: what the solution prints is discarded (so it cannot push the result line
# out of the captured output), the modules it may not use are made unimportable, and every case's outcome is printed
# on one line after the nonce, for the host to judge.
RUNNER = '''import ast, io, json, sys
nonce = sys.stdin.readline().strip()
{canon}
cases = ast.literal_eval(open(".k3_check/cases.txt").read())
source = open({path!r}).read()
for m in {blocked!r}:
    sys.modules[m] = None
out, sys.stdout = sys.stdout, io.StringIO()
namespace = {{"__name__": "solution"}}
exec(compile(source, {path!r}, "exec"), namespace)
fn = namespace[{name!r}]
results = []
for args in cases:
    try:
        results.append(canon(fn(*args)))
    except (Exception, SystemExit) as e:
        results.append(["raises", type(e).__name__])
    sys.stdout.seek(0)
    sys.stdout.truncate()
out.write(nonce + json.dumps(results) + "\\n")
'''


def same(got, want) -> bool:
    """Canonical values equal, floats (and an int where a float is due) within 1e-9 relative."""
    if want[0] == "float" and got[0] in ("float", "int") and not isinstance(want[1], str):
        return not isinstance(got[1], str) and abs(got[1] - want[1]) <= 1e-9 * max(1.0, abs(want[1]))
    if want[0] in ("list", "tuple", "set", "frozenset", "dict") and got[0] == want[0]:
        return len(got[1]) == len(want[1]) and all(same(g, w) for g, w in zip(got[1], want[1]))
    if want[0] == "int" and got[0] == "float":
        return same(want, got)
    return got == want


def show(c) -> str:
    """A canonical value written back as Python (for the verdict's details)."""
    kind, v = c
    if kind in ("list", "tuple", "set", "frozenset"):
        inner = ", ".join(map(show, v)) + ("," if kind == "tuple" and len(v) == 1 else "")
        return {"list": "[{}]", "tuple": "({})", "set": "{{{}}}", "frozenset": "frozenset({{{}}})"}[kind].format(inner)
    if kind == "dict":
        return "{" + ", ".join(f"{show(k)}: {show(x)}" for k, x in v) + "}"
    if kind in ("bytes", "bytearray"):
        return repr(bytes.fromhex(v))
    if kind == "raises":
        return f"raises {v}"
    return v if kind == "repr" or (kind == "float" and isinstance(v, str)) else repr(v)


def reference(problem: Problem):
    ns: dict = {}
    exec(problem.source, ns)
    return ns[problem.name]


def _cases(problem: Problem, variant: int, part: str, n: int) -> list[tuple]:
    """`n` inputs of `problem` (distinct where the generator allows), a pure function of (problem, variant, part)."""
    rng = random.Random(f"code/{problem.name}/{variant}/{part}")
    out: list[tuple] = []
    for _ in range(20 * n):
        args = problem.gen(rng)
        if args not in out:
            out.append(args)
        if len(out) == n:
            break
    return out


def _call(args: tuple, name: str) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def stub(problem: Problem, examples: list[tuple]) -> str:
    """The function's signature and docstring (the examples appended), with a body that raises."""
    node = ast.parse(problem.source).body[0]
    lines = problem.source.splitlines()
    signature = "\n".join(lines[node.lineno - 1:node.body[0].lineno - 1])
    ref = reference(problem)
    doc = ast.get_docstring(node) + "\n\n" + "\n".join(f">>> {_call(a, problem.name)}\n{ref(*a)!r}" for a in examples)
    body = '"""' + doc + '\n"""\nraise NotImplementedError\n'
    return signature + "\n" + textwrap.indent(body, "    ", lambda line: line.strip() != "")


def test_file(problem: Problem, cases: list[tuple], module: str, filename: str) -> str:
    """A test script for the workspace: each case's expected value written out, floats compared within 1e-9
    relative (as the hidden verifier does); prints the failures and exits non-zero when there are any."""
    ref = reference(problem)
    rows = "\n".join(f"    ({a!r}, {ref(*a)!r})," for a in cases)
    return (f'"""Tests of {module}.{problem.name}: python3 {filename}"""\nfrom {module} import {problem.name}\n\n'
            f"CASES = [\n{rows}\n]\n\n\n"
            "def same(a, b):\n"
            "    if isinstance(b, float) or isinstance(a, float):\n"
            "        return isinstance(a, (int, float)) and abs(a - b) <= 1e-9 * max(1.0, abs(b))\n"
            "    if isinstance(b, (list, tuple)):\n"
            "        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))\n"
            "    return type(a) is type(b) and a == b\n\n\n"
            "failed = 0\nfor args, want in CASES:\n"
            f"    got = {problem.name}(*args)\n    if not same(got, want):\n        failed += 1\n"
            f"        print(f'FAIL {problem.name}{{args!r}}: got {{got!r}}, expected {{want!r}}')\n"
            "print(f'{len(CASES) - failed}/{len(CASES)} passed')\nraise SystemExit(1 if failed else 0)\n")


def _function_dump(tree: ast.AST, name: str) -> str | None:
    """The AST of the function `name` in `tree` without its docstring, for comparing code written differently only
    in layout and comments."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            return ast.dump(ast.Module(body=body, type_ignores=[]))
    return None


def _original_dump(problem: Problem) -> str | None:
    mod, fn = problem.original.rsplit(".", 1)
    try:
        source = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(mod), fn)))
    except (OSError, TypeError):  # a C function or a class: nothing to copy as a function
        return None
    return _function_dump(ast.parse(source), fn)


def rules(problem: Problem) -> str:
    """What a solution may not do, as the prompt says it (`refusal` enforces it)."""
    modules = sorted(set(ALWAYS_FORBIDDEN) | set(problem.forbid))
    copy = f", nor copy the source of {problem.original}" if problem.original else ""
    return f"do not import {', '.join(modules)}, nor use {', '.join(FORBIDDEN_CALLS)}{copy}"


def refusal(source: str, problem: Problem) -> str | None:
    """Why the solution does not implement the function itself (None when nothing is wrong): it imports the module
    the function comes from (or one that reaches it), calls __import__/exec/eval, or is the original's code."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # not a hack; the hidden tests fail it
    forbidden = set(ALWAYS_FORBIDDEN) | set(problem.forbid)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.split(".")[0] in forbidden else []
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_CALLS:
            return f"uses {node.id}, which this task does not allow"
        for n in names:
            if n.split(".")[0] in forbidden:
                return f"uses the module {n!r}, which this task forbids ({', '.join(sorted(forbidden))})"
    if problem.original:
        orig = _original_dump(problem)
        if orig is not None and _function_dump(tree, problem.name) == orig:
            return f"is a copy of {problem.original}"
    return None


def judge_cases(sandbox, problem: Problem, cases: list[tuple], *, path: str = "solution.py",
                what: str = "hidden tests") -> Verdict:
    """Run the function `problem.name` of the file `path` in `sandbox` (a fork) on `cases` and judge its outputs
    on the host against the reference's: reward 1 when all pass, the pass fraction in the data. `what` names the
    cases in the details ("hidden tests", "public tests")."""
    try:
        source = sandbox.read_file(path).decode("utf-8", "replace")
    except SandboxError as e:  # a missing file is a failed attempt, not an error
        return Verdict(0.0, False, f"no {path}: {e}", {"pass_fraction": 0.0})
    why = refusal(source, problem)
    if why is not None:
        return Verdict(0.0, False, f"refused: {path} {why}", {"pass_fraction": 0.0, "refused": why})
    blocked = sorted(set(ALWAYS_FORBIDDEN) | set(problem.forbid))
    runner = RUNNER.format(canon=CANON, blocked=blocked, name=problem.name, path=path)
    got, res = run_check(sandbox, {"run.py": runner, "cases.txt": repr(cases)}, "run.py", timeout=CHECK_SECONDS)
    if got is None or len(got) != len(cases):
        return Verdict(0.0, False, f"the {what} did not run: {describe_failure(res)}", {"pass_fraction": 0.0})
    ref = reference(problem)
    failures = []
    for args, out in zip(cases, got):
        try:
            want = canon(ref(*args))
        except Exception as e:  # noqa: BLE001 (the reference's exception is the expected outcome)
            want = ["raises", type(e).__name__]
        if not same(out, want):
            failures.append(f"{_call(args, problem.name)}: got {show(out)}, expected {show(want)}")
    passed = len(cases) - len(failures)
    ok = not failures
    details = f"{passed}/{len(cases)} {what} passed" + ("" if ok else "; failures: " + "; ".join(failures[:3]))
    return Verdict(float(ok), ok, details, {"pass_fraction": passed / len(cases), "passed": passed,
                                            "total": len(cases)})


def make_task(problem: Problem, variant: int, split: str) -> Task:
    examples = _cases(problem, variant, "public", PUBLIC_CASES)
    hidden = examples + _cases(problem, variant, "hidden", HIDDEN_CASES)
    prompt = (f"Implement `{problem.name}` in solution.py from its signature and docstring. "
              "`python3 test_public.py` checks the docstring's examples; hidden tests check more inputs. "
              f"Write the function yourself: {rules(problem)}.")
    return Task(id=f"code/{problem.name}/{variant}", family="code", prompt=prompt, split=split,
                verify=lambda sandbox, answer: judge_cases(sandbox, problem, hidden),
                image={"solution.py": stub(problem, examples),
                       "test_public.py": test_file(problem, examples, "solution", "test_public.py")},
                budget=Budget(turns=20, tokens=16384, wall_seconds=900.0),
                metadata={"problem": problem.name, "variant": variant, "original": problem.original})


def split_problems(split: str) -> list[Problem]:
    return [p for p in PROBLEMS if split_of(f"code/{p.name}", TEST_FRACTION) == split]


@register_family("code")
class Code(TaskFamily):
    description = "implement a function from its signature and docstring; hidden tests on more inputs"

    def instances(self, split: str, n: int, seed: int = 0) -> Iterator[Task]:
        check_n(split, n)
        problems = split_problems(split)
        random.Random(f"code/{split}/{seed}").shuffle(problems)
        for i in range(n):
            yield make_task(problems[i % len(problems)], seed + i // len(problems), split)

    @staticmethod
    def scripted_solution(task: Task) -> list[dict]:
        """Write the reference implementation, run the public tests, submit."""
        problem = PROBLEMS_BY_NAME[task.metadata["problem"]]
        return [action("write_file", path="solution.py", content=problem.source),
                action("shell", command="python3 test_public.py"), action("submit", answer="solution.py")]
