"""Timing a kernel in the candidate's process: warm-up calls, then timed calls each on fresh inputs, the median.

The warm-up is at least `Timing.warmup` calls and, on CUDA, at least `Timing.warmup_s` seconds of them: a GPU
that was idle runs at lower clocks for a while, and a few calls of a sub-millisecond kernel end before they
rise (an expert timed in a fresh process after 3 warm-up calls varied by up to 1.5x from process to process on
an H200).

Every call gets inputs it has never seen (built before the timer starts), so neither a cache of inputs nor of
outputs can help. On CUDA the L2 cache is flushed before each call (a write of twice its size), the timer starts
on the current stream and stops after ``torch.cuda.synchronize()``, which waits for every stream of the device:
work on side streams is inside the time. On CPU the timer is ``time.perf_counter``. The timer functions are
bound when this module is imported, before any candidate code runs, so a candidate that replaces
``time.perf_counter`` or ``torch.cuda.synchronize`` does not change what is measured (the tampering detector
reports it).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Timing", "time_calls"]

_perf_counter = time.perf_counter
_cuda_synchronize = torch.cuda.synchronize
_CudaEvent = torch.cuda.Event
L2_FLUSH_BYTES = 256 << 20  # H200: 50 MB of L2; written whole before each timed call


@dataclass(frozen=True)
class Timing:
    warmup: int = 3
    warmup_s: float | None = None  # warm-up calls until this much time has passed (None: 0.25 on CUDA, 0 on CPU)
    max_warmup: int = 10_000
    repeats: int = 50
    min_repeats: int = 5
    budget_s: float = 2.0  # stop after this much timed work once min_repeats are done


def time_calls(kernel: Callable, make_args: Callable[[int], tuple], device: str, timing: Timing,
               on_output: Callable[[int, tuple, object], None]) -> list[float]:
    """Call `kernel(*make_args(i))`: untimed warm-up calls for i = -1, -2, ... (at least `timing.warmup`, and
    until `timing.warmup_s` seconds have passed, at most `timing.max_warmup`), then timed ones for i = 0, 1, ...
    until `timing.repeats` (or the budget, after `timing.min_repeats`). `on_output(i, args, out)` sees every
    output (i < 0 for warm-up calls). Returns the timed calls' seconds."""
    cuda = device == "cuda"
    warmup_s = timing.warmup_s if timing.warmup_s is not None else (0.25 if cuda else 0.0)
    t0, n = _perf_counter(), 0
    while n < timing.warmup or (n < timing.max_warmup and _perf_counter() - t0 < warmup_s):
        n += 1
        args = make_args(-n)
        out = kernel(*args)
        if cuda:
            _cuda_synchronize()  # the time is the device's, not the launch queue's
        on_output(-n, args, out)
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda") if cuda else None
    times: list[float] = []
    spent = 0.0
    for i in range(timing.repeats):
        if i >= timing.min_repeats and spent > timing.budget_s:
            break
        args = make_args(i)
        if cuda:
            flush.zero_()
            _cuda_synchronize()
            start, end = _CudaEvent(enable_timing=True), _CudaEvent(enable_timing=True)
            start.record()
            out = kernel(*args)
            _cuda_synchronize()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = _perf_counter()
            out = kernel(*args)
            dt = _perf_counter() - t0
        on_output(i, args, out)
        times.append(dt)
        spent += dt
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)
