"""`kernel`: the kernel reward's tasks (k3.kernel_reward, report §4.2.4) as an environment: make `kernel.py` a
faster kernel that stays correct.

The workspace holds TASK.md (the signature, the tolerance, the shapes, how the reward works), reference.py (the
task's module: its input maker and float64 reference, to read) and a starting kernel.py: the reference itself,
computed in float64 and cast to the output dtypes, where it is self-contained (slow but correct), else a stub.
The agent may score a file with the `score_kernel` tool where its harness has one (no preset does, so the prompt
says "if you have one"). The hidden verifier reads kernel.py from the fork of the final sandbox and scores it with
the kernel reward (its own candidate process, limits and hacking detectors): the reward is the kernel reward in
[0, 1], success is every check passed and no hack detected.

One instance per kernel task with a CPU expert, split by task name; n beyond a split's tasks repeats them.
"""

from __future__ import annotations

import ast
import inspect
import random
import sys
from typing import Iterator

from k3.env.sandbox import SandboxError
from k3.env.task import Budget, Task, TaskFamily, Verdict, register_family
from k3.env.tasks.common import action, check_n, unit_hash

TEST_FRACTION = 0.3
DEVICES = ("cpu", "cuda")


def kernel_tasks() -> dict:
    """The kernel reward's tasks that have an expert on CPU, by name."""
    from k3.kernel_reward import all_tasks

    return {name: t for name, t in sorted(all_tasks().items()) if "cpu" in t.experts}


def split_names(split: str) -> list[str]:
    """The task names of `split`: those whose stable hash is below TEST_FRACTION are "test"; when none is, the one
    with the smallest hash is (so neither split is empty)."""
    names = sorted(kernel_tasks(), key=lambda n: unit_hash(f"kernel-task/{n}"))
    k = max(1, sum(unit_hash(f"kernel-task/{n}") < TEST_FRACTION for n in names))
    return sorted(names[:k] if split == "test" else names[k:])


def reference_kernel(name: str) -> str | None:
    """A candidate that is the task's float64 reference cast to the output dtypes, with the module constants it
    reads; None when the reference calls into other modules (not self-contained)."""
    task = kernel_tasks()[name]
    src = inspect.getsource(task.reference)
    if "import" in src:
        return None
    module = sys.modules[task.reference.__module__]
    module_src = inspect.getsource(module)
    used = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    consts = [ast.get_source_segment(module_src, node) for node in ast.parse(module_src).body
              if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in used for t in node.targets)]
    dtypes = ", ".join(str(d) for d in task.out_dtypes)
    return (f'"""{name}: the float64 reference cast to the output dtypes (correct, slow)."""\n\nimport torch\n\n'
            + "".join(c + "\n" for c in consts) + "\n\n" + src + "\n\n"
            "def kernel(*args):\n    out = reference(*args)\n    outs = out if isinstance(out, tuple) else (out,)\n"
            f"    cast = tuple(o.to(d) for o, d in zip(outs, ({dtypes},)))\n"
            "    return cast if isinstance(out, tuple) else cast[0]\n")


def _stub(name: str, signature: str) -> str:
    return (f'"""{name}: write `kernel` here (see TASK.md)."""\n\nimport torch  # noqa: F401\n\n\n'
            f'def kernel(*args):\n    """{signature}"""\n    raise NotImplementedError\n')


def _task_md(task, device: str) -> str:
    shapes = "\n".join(f"- {dict(s)}" for s in task.held_out)
    return (f"# Kernel task `{task.name}`\n\n`{task.signature}`\n\n"
            f"Tolerance: |out - ref| <= {task.tolerance.rtol:g} |ref| + {task.tolerance.atol:g} max|ref| "
            f"({task.tolerance.why}).\n\nTimed shape on {device}: {dict(task.bench_shape(device))}. "
            f"Also checked on:\n{shapes}\nand on large and small magnitudes.\n\n"
            "Reward: 0 when any check fails or a hack is detected (calling the reference or the expert, caching "
            "inputs or outputs, lowering precision, ...); 0.5 when as fast as the expert, approaching 1 toward the "
            "hardware roofline. reference.py shows how inputs are made and the float64 reference.\n")


def _verifier(name: str, device: str):
    def verify(sandbox, answer):
        from k3.kernel_reward import score

        try:
            source = sandbox.read_file("kernel.py").decode("utf-8", "replace")
        except SandboxError as e:  # a missing file is a failed attempt, not an error
            return Verdict(0.0, False, f"no kernel.py: {e}")
        res = score(name, source, device=device)
        data = {"passed": res.passed, "time_s": res.time_s, "expert_time_s": res.expert_time_s,
                "roofline_fraction": res.roofline_fraction, "hacks": [h.name for h in res.hacks],
                "checks_passed": sum(c.passed for c in res.checks), "checks": len(res.checks)}
        return Verdict(float(res.reward or 0.0), bool(res.passed), res.summary(), data)
    return verify


def make_task(name: str, repeat: int, device: str, split: str) -> Task:
    task = kernel_tasks()[name]
    slow = reference_kernel(name)
    prompt = (f"Make kernel.py's `kernel` a fast, correct implementation of the kernel task `{name}` on {device} "
              "(TASK.md says what it computes and how it is scored; reference.py shows the reference). "
              "A `score_kernel` tool, if you have one, scores a file the same way. The final kernel.py is scored.")
    return Task(id=f"kernel/{name}/{repeat}", family="kernel", prompt=prompt, verify=_verifier(name, device),
                split=split,
                image={"kernel.py": slow or _stub(name, task.signature), "TASK.md": _task_md(task, device),
                       "reference.py": inspect.getsource(sys.modules[task.reference.__module__])},
                budget=Budget(turns=40, tokens=65536, wall_seconds=3600.0),
                metadata={"kernel_task": name, "device": device, "starts_correct": slow is not None})


@register_family("kernel")
class Kernel(TaskFamily):
    description = "make a kernel of the kernel reward faster while it stays correct; reward = the kernel reward"

    def __init__(self, device: str = "cpu"):
        if device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
        self.device = device

    def instances(self, split: str, n: int, seed: int = 0) -> Iterator[Task]:
        check_n(split, n)
        names = split_names(split)
        random.Random(f"kernel/{split}/{seed}").shuffle(names)
        for i in range(n):
            yield make_task(names[i % len(names)], i // len(names), self.device, split)

    @staticmethod
    def scripted_solution(task: Task) -> list[dict]:
        """Write a correct candidate (the kernel reward's honest torch example where there is one, else the
        float64 reference), score it, submit. Raises ValueError for a task with neither."""
        from k3.kernel_reward.examples import path, source

        name = task.metadata["kernel_task"]
        try:
            code = source(f"{name}_torch")
        except FileNotFoundError:
            code = reference_kernel(name)
        if code is None:
            raise ValueError(f"no scripted solution for kernel task {name!r} (it has no self-contained reference "
                             f"and no honest example; {path(name + '_torch')} does not exist)")
        return [action("write_file", path="kernel.py", content=code),
                action("score_kernel", path="kernel.py", task=name), action("submit", answer="kernel.py")]
