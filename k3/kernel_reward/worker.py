"""The candidate's process: ``python -m k3.kernel_reward.worker SPEC.json`` (started by k3.kernel_reward.runner).

In order: block the network, install the watches (k3.kernel_reward.guard), import the candidate, then

* check: call the kernel on every correctness case and on the detectors' calls (a first call, one on fresh
  inputs of the same shape, one on the first call's inputs overwritten in place), writing the outputs
  (check.safetensors) and the facts (check.json) into the run directory, never judging them;
* time (after the harness writes "time" into the run directory's ``go`` file, when the spec says to wait, so that the harness decides and can serialize):
  k3.kernel_reward.timing on fresh inputs every call, writing the times and a sample of the timed outputs
  (time.json, time.safetensors) for the harness to check.

A kernel exception ends the phase with the error written down; anything worse (a crash, a hang, running out of
memory) the harness sees from outside.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
import time
import traceback

from k3.kernel_reward import guard, timing  # bound before the candidate runs (timing's timer functions)
from k3.kernel_reward.outputs import save_outputs, storable

MAX_KEPT_BYTES = 256 << 20  # timed outputs kept for checking: all of them below this, else a random sample
SAMPLED = 3


def _write(directory: str, name: str, payload: dict, tensors: list | None = None) -> None:
    if tensors is not None:  # first: the harness reads the outputs once the JSON exists
        save_outputs(os.path.join(directory, f"{name}.safetensors"), tensors)
    path = os.path.join(directory, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def _cpu(outs: tuple) -> list:
    return [o.detach().to("cpu") if storable(o) else None for o in outs]


def _error(stage: str, e: BaseException) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"stage": stage, "type": type(e).__name__, "message": str(e)[:2000], "traceback": "".join(tb)[-4000:]}


def load(path: str):
    spec = importlib.util.spec_from_file_location("candidate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidate"] = module
    spec.loader.exec_module(module)
    kernel = getattr(module, "kernel", None)
    if not callable(kernel):
        raise TypeError(f"{path} defines no callable `kernel`")
    return kernel


def check_phase(task, kernel, device: str, watch) -> tuple[dict, list]:
    from k3.kernel_reward.task import Case, cases

    bench = task.bench_shape(device)
    calls, outputs = [], []

    def run(case: Case, args=None):
        args = task.make(case.shape, case.seed, case.magnitude, device) if args is None else args
        outs, facts = guard.call(kernel, args, device, watch)
        calls.append({"case": case.to_dict(), "facts": facts})
        outputs.append(_cpu(outs))
        return args

    try:
        for case in cases(task, device):
            run(case)
        first = run(Case("repeat-first", bench, 401))
        run(Case("repeat-fresh", bench, 402))
        mutated = Case("repeat-mutated", bench, 403)
        guard.overwrite(first, task.make(mutated.shape, mutated.seed, mutated.magnitude, device))
        run(mutated, first)
        error = None
    except BaseException as e:  # the kernel raised: written down, the phase ends
        error = _error(f"call {len(calls)}", e)
    return {"calls": calls, "error": error}, outputs


def time_phase(task, kernel, device: str, spec: dict) -> tuple[dict, list]:
    import torch

    from k3.kernel_reward.task import Case

    opts = timing.Timing(**spec.get("timing", {}))
    shape = task.bench_shape(device)
    kept: dict[int, list] = {}
    types: list[str] = []
    sample: set[int] | None = None  # decided at the first timed call, from its output's size

    def on_output(i, args, out):
        nonlocal sample
        outs = out if isinstance(out, tuple) else (out,)
        types.extend(f"{type(o).__module__}.{type(o).__qualname__}" for o in outs if type(o) is not torch.Tensor)
        if i < 0:
            return
        if sample is None:
            size = sum(o.numel() * o.element_size() for o in outs if type(o) is torch.Tensor)
            if size * opts.repeats <= MAX_KEPT_BYTES:
                sample = set(range(opts.repeats))
            else:  # among the calls that always happen, chosen where the candidate cannot see it beforehand
                sample = set(secrets.SystemRandom().sample(range(opts.min_repeats), min(SAMPLED, opts.min_repeats)))
        if i in sample:
            kept[i] = _cpu(outs)

    def make_args(i):  # timed calls: seeds 1000, 1001, ...; warm-up calls (i < 0): 1000001, 1000002, ...
        return task.make(shape, 1000 + i if i >= 0 else 1_000_000 - i, "normal", device)

    try:
        times = timing.time_calls(kernel, make_args, device, opts, on_output)
        error = None
    except BaseException as e:
        times, error = [], _error("timing", e)
    calls = [{"case": Case("timed", shape, 1000 + i).to_dict(), "facts": {"types": types}} for i in sorted(kept)]
    return {"times": times, "calls": calls, "error": error}, [kept[i] for i in sorted(kept)]


def _wait_go(directory: str) -> str:
    """The harness's decision after the checks: "time" or "stop" (the file it writes)."""
    path = os.path.join(directory, "go")
    while not os.path.exists(path):
        time.sleep(0.01)
    with open(path) as f:
        return f.read().strip()


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    guard.block_network()
    import torch

    from k3.kernel_reward.tasks import get

    device, directory = spec["device"], spec["dir"]
    if device == "cuda" and spec.get("gpu_memory_fraction"):
        torch.cuda.set_per_process_memory_fraction(spec["gpu_memory_fraction"])
    task = get(spec["task"])
    watch = guard.Watch(() if spec.get("trusted") else task.forbidden)
    try:
        kernel = load(spec["candidate"])
    except BaseException as e:
        _write(directory, "check", {"calls": [], "error": _error("import", e), "process": [watch.facts()]}, [])
        return 0
    process = [watch.facts()]
    if "check" in spec["phases"]:
        payload, outputs = check_phase(task, kernel, device, watch)
        process.append(watch.facts())
        _write(directory, "check", {**payload, "process": process}, outputs)
        if payload["error"] is not None or "time" not in spec["phases"]:
            return 0
        if spec.get("wait") and _wait_go(directory) != "time":
            return 0
    if "time" in spec["phases"]:
        payload, outputs = time_phase(task, kernel, device, spec)
        process.append(watch.facts())
        _write(directory, "time", {**payload, "process": process}, outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
