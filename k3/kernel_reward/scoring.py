"""Scoring: a candidate's source in, a `Result` out (the reward of report §4.2.4).

    score(task, source) -> Result                 one candidate: its process checks, then (if every check
                                                  passed and no hack showed) times it
    score_many(task, sources, jobs=4) -> [Result] many: their checks in parallel processes, then each passing
                                                  one timed alone, one after the other

The harness, not the candidate's process, computes every reference (on the scoring device, in float64) and judges
every output: the correctness cases, the detectors' calls, and the timed calls' outputs. The expert's time is
measured the same way (its own process, checked and then timed like a candidate) once per task and device in this
process.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from k3.kernel_reward import ceilings as ceil
from k3.kernel_reward.hacks import Call, Evidence, detect
from k3.kernel_reward.result import Check, Result
from k3.kernel_reward.reward import effective_roofline, reward
from k3.kernel_reward.runner import Failure, Limits, Run
from k3.kernel_reward.task import Case, Task, as_tuple, compare, relative_error
from k3.kernel_reward.tasks import get
from k3.kernel_reward.timing import median

__all__ = ["expert_time", "score", "score_many", "source_of"]


def _device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda, but no CUDA device is available: use cpu")
    return device


def source_of(impl: str) -> str:
    """A candidate's source that is the function `impl` ("module:function")."""
    mod, fn = impl.split(":")
    return f"from {mod} import {fn} as kernel\n"


# --- references and checks (in this process) ---------------------------------------------------------------------

_refs: dict[tuple, tuple] = {}
_refs_lock = threading.Lock()
_REF_CACHE_ELEMENTS = 1 << 24


def _reference(task: Task, case: Case, device: str) -> tuple:
    key = (task.name, device, tuple(sorted(case.shape.items())), case.seed, case.magnitude)
    with _refs_lock:
        if key in _refs:
            return _refs[key]
    with torch.no_grad():
        ref = as_tuple(task.reference(*task.make(case.shape, case.seed, case.magnitude, device)))
    if sum(r.numel() for r in ref) <= _REF_CACHE_ELEMENTS // 16:
        with _refs_lock:
            if sum(r.numel() for v in _refs.values() for r in v) > _REF_CACHE_ELEMENTS:
                _refs.clear()
            _refs[key] = ref
    return ref


def _judge(task: Task, device: str, payload: dict, tensors: list, phase: str) -> list[Call]:
    """Every call of a phase, checked against the reference of its inputs."""
    calls = []
    for rec, outs in zip(payload["calls"], tensors):
        case = Case.from_dict(rec["case"])
        ref = _reference(task, case, device)
        tol = task.precision if case.label == "precision" and task.precision else task.tolerance
        error, rel = None, None
        if len(outs) != len(ref):
            error = f"returned {len(outs)} outputs, expected {len(ref)}"
        else:
            for j, (o, r, dt) in enumerate(zip(outs, ref, task.out_dtypes)):
                types = rec["facts"].get("types", [])
                if o is None and j < len(types):
                    error = f"output {j} is a {types[j]}, not a plain tensor"
                    break
                why = compare(o.to(device) if isinstance(o, torch.Tensor) else o, r, dt, tol)
                if why is not None:
                    error = f"output {j}: {why}" if len(ref) > 1 else why
                    if isinstance(o, torch.Tensor) and o.shape == r.shape:
                        rel = relative_error(o.to(device), r)
                    break
        calls.append(Call(case, phase, rec["facts"], error, rel, tuple(outs)))
    return calls


def _checks(calls: list[Call]) -> list[Check]:
    return [Check(c.case.label, dict(c.case.shape), c.case.seed, c.case.magnitude, c.phase, c.error is None, c.error)
            for c in calls]


def _verdict(res: Result, calls: list[Call], ev: Evidence) -> None:
    res.checks = _checks(calls)
    res.hacks = detect(ev)
    bad = next((c for c in calls if c.error is not None), None)
    reasons = []
    if bad is not None:
        reasons.append(f"wrong result on the {bad.case.describe()}: {bad.error}")
    if res.hacks:
        reasons.append("hack detected: " + "; ".join(f"{h.name} ({h.detail})" for h in res.hacks))
    res.reason = "; ".join(reasons)
    res.passed = not reasons


# --- timing and the reward ---------------------------------------------------------------------------------------

_expert_times: dict[tuple, tuple[str, float]] = {}
# fresh processes whose medians the anchor is the median of: on the H200 one process ran the same small kernel up to
# 1.6x faster or slower than the next (BENCHMARKS.md); on CPU one, since CPU rewards test the harness, not the kernel
ANCHOR_PROCESSES = {"cuda": 3, "cpu": 1}


def expert_time(task: Task | str, device: str | None = None, *, timing: dict | None = None,
                limits: Limits = Limits(), refresh: bool = False, checked: bool = True,
                processes: int | None = None) -> tuple[str, float]:
    """(the expert's "module:function", its time) for `task` on `device`, measured once per process (`refresh`:
    measured again, in new processes, and kept).

    The expert is timed the way a candidate is: its own process runs every correctness case and detector call
    first, the harness judges them (an expert that fails raises, naming the check: its time would be no anchor),
    and then the same process is timed. Whatever the checks leave behind in a process (compiled and autotuned
    kernels, the allocator's pool, the device's clocks) is then the same for the anchor as for every candidate.
    `checked=False` times processes that run nothing before the timed calls (as batch scoring times candidates).
    The time is the median over `processes` such processes (default `ANCHOR_PROCESSES` for the device) of each
    one's median: one process's time of a small kernel varies too much to be the reward's 0.5 alone."""
    task = get(task) if isinstance(task, str) else task
    device = _device(device)
    n = ANCHOR_PROCESSES.get(device, 1) if processes is None else processes
    if n < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    key = (task.name, device, tuple(sorted((timing or {}).items())), checked, n)
    if refresh or key not in _expert_times:
        impl = task.expert(device)
        medians = [_expert_process_time(task, impl, device, timing, limits, checked) for _ in range(n)]
        _expert_times[key] = (impl, median(medians))
    return _expert_times[key]


def _expert_process_time(task: Task, impl: str, device: str, timing: dict | None, limits: Limits,
                         checked: bool) -> float:
    """The median time of the expert `impl` in one fresh process (checked first when `checked`)."""
    with tempfile.TemporaryDirectory(prefix="k3-kr-") as d:
        path = os.path.join(d, "expert.py")
        with open(path, "w") as f:
            f.write(source_of(impl))
        run = Run(task.name, path, device, d, phases=("check", "time") if checked else ("time",), limits=limits,
                  timing=timing, trusted=True)
        try:
            if checked:
                res = Result(task.name, impl, device)
                _check(res, run, task, device)
                if not res.passed:
                    raise RuntimeError(f"the expert of {task.name} ({impl}) failed its checks on {device}: "
                                       f"{res.reason}")
            got = run.time()
        finally:
            run.close()
    if isinstance(got, Failure):
        raise RuntimeError(f"the expert of {task.name} ({impl}) failed on {device}: {got.reason}")
    return median(got[0]["times"])


def _reward(res: Result, task: Task, device: str, times: list[float], expert: tuple[str, float]) -> None:
    shape = task.bench_shape(device)
    c = ceil.ceilings(device)
    res.times_s = times
    res.time_s = median(times)
    res.expert, res.expert_time_s = expert
    res.roofline_time_s = ceil.roofline_time(task.flops(shape), task.bytes(shape), c)
    res.roofline_fraction = res.roofline_time_s / res.time_s
    res.ceilings = c.source
    if effective_roofline(res.expert_time_s, res.roofline_time_s) != res.roofline_time_s:
        res.ceilings += "; the expert beat this roofline, so the formula takes t_expert/2"
    res.reward = reward(res.time_s, res.expert_time_s, res.roofline_time_s) if res.passed else 0.0


def _timed(res, run, task, device, calls, process_before, timed_expert):
    """Time through `run` (its process already checked, or started for timing only) and finish `res`."""
    got = run.time()
    if isinstance(got, Failure):
        res.passed, res.reward, res.reason = False, 0.0, f"{got.kind} while timing: {got.reason}"
        return
    payload, tensors = got
    calls = calls + _judge(task, device, payload, tensors, "time")
    _verdict(res, calls, Evidence(task, device, calls, process_before + payload["process"]))
    _reward(res, task, device, payload["times"], timed_expert)


def _prepare(task, device):
    task = get(task) if isinstance(task, str) else task
    return task, _device(device)


def score(task: Task | str, source: str, device: str | None = None, *, name: str = "candidate", timed: bool = True,
          limits: Limits = Limits(), timing: dict | None = None, expert: tuple[str, float] | None = None,
          trusted: bool = False, anchor_processes: int | None = None) -> Result:
    """Score one candidate (Python source defining ``kernel``) on `task`. `timed=False` stops after the checks
    (reward None when they pass). `expert`: (name, seconds) instead of measuring the expert (else `expert_time`
    over `anchor_processes` processes). `trusted` turns off the forbidden-call detector (to score the expert
    itself)."""
    task, device = _prepare(task, device)
    t0 = time.monotonic()
    res = Result(task.name, name, device)
    with tempfile.TemporaryDirectory(prefix="k3-kr-") as d:
        path = os.path.join(d, "candidate.py")
        with open(path, "w") as f:
            f.write(source)
        run = Run(task.name, path, device, d, phases=("check", "time") if timed else ("check",), limits=limits,
                  timing=timing, trusted=trusted)
        try:
            calls, process = _check(res, run, task, device)
            if timed and res.passed:
                timed_expert = expert or expert_time(task, device, timing=timing, limits=limits,
                                                    processes=anchor_processes)
                _timed(res, run, task, device, calls, process, timed_expert)
        finally:
            run.close()
    if not timed and res.passed:
        res.reward = None
    res.overhead_s = time.monotonic() - t0 - sum(res.times_s)
    return res


def _check(res: Result, run: Run, task: Task, device: str):
    got = run.check()
    if isinstance(got, Failure):
        res.passed, res.reward, res.reason = False, 0.0, f"{got.kind}: {got.reason}"
        return [], []
    payload, tensors = got
    calls = _judge(task, device, payload, tensors, "check")
    _verdict(res, calls, Evidence(task, device, calls, payload["process"]))
    return calls, payload["process"]


def score_many(task: Task | str, sources: Sequence[tuple[str, str]], device: str | None = None, *, jobs: int = 4,
               timed: bool = True, limits: Limits = Limits(), timing: dict | None = None,
               expert: tuple[str, float] | None = None, anchor_processes: int | None = None) -> list[Result]:
    """Score many (name, source) candidates: their checks in up to `jobs` processes at a time, then every one
    that passed timed alone, one after another (nothing else runs while a candidate is timed), each in a new
    process that runs only the timed calls; the expert's anchor is timed the same way (expert_time, checked=False,
    over `anchor_processes` processes)."""
    task, device = _prepare(task, device)

    def check_one(item):
        name, source = item
        t0 = time.monotonic()
        res = Result(task.name, name, device)
        d = tempfile.mkdtemp(prefix="k3-kr-")
        path = os.path.join(d, "candidate.py")
        with open(path, "w") as f:
            f.write(source)
        run = Run(task.name, path, device, d, phases=("check",), limits=limits, timing=timing)
        try:
            calls, process = _check(res, run, task, device)
        finally:
            run.close()
        return res, calls, process, path, time.monotonic() - t0

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        checked = list(pool.map(check_one, sources))
    timed_expert = expert
    results = []
    for res, calls, process, path, spent in checked:
        t0 = time.monotonic()
        if timed and res.passed:
            # timed in a fresh process that ran no checks: so is the anchor (the same procedure on both sides)
            timed_expert = timed_expert or expert_time(task, device, timing=timing, limits=limits, checked=False,
                                                       processes=anchor_processes)
            run = Run(task.name, path, device, os.path.dirname(path), phases=("time",), limits=limits, timing=timing)
            try:
                _timed(res, run, task, device, calls, process, timed_expert)
            finally:
                run.close()
        elif not timed and res.passed:
            res.reward = None
        res.overhead_s = spent + time.monotonic() - t0 - sum(res.times_s)
        _remove(os.path.dirname(path))
        results.append(res)
    return results


def _remove(directory: str) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
