"""The hardware ceilings a roofline is drawn against: a matrix-product rate (FLOP/s) and a copy bandwidth
(bytes read + written per second).

CUDA: the H200 figures measured on the project's machine (GPU.md, 2026-11-29): bf16 matrix product 8192^3 at
803 TFLOP/s, device-to-device copy at 4.0 TB/s. CPU: measured once per process (an fp32 matrix product and a
large copy, best of a few repeats), so a CPU roofline is relative to the machine the tests run on.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

__all__ = ["Ceilings", "ceilings", "roofline_time"]


@dataclass(frozen=True)
class Ceilings:
    flops: float  # FLOP/s of a large matrix product
    bandwidth: float  # bytes/s, read + write, of a large copy
    source: str


H200 = Ceilings(803e12, 4.0e12, "H200, GPU.md: bf16 matmul 8192^3 803 TFLOP/s, D2D copy 4.0 TB/s")


def _best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def ceilings(device: str) -> Ceilings:
    """The ceilings of `device` ("cuda" or "cpu"); the CPU's are measured on first use."""
    if device == "cuda":
        return H200
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _best(lambda: a @ b)
    x = torch.randn(8 << 20)  # 32 MiB, past the last-level cache
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / _best(lambda: y.copy_(x))
    return Ceilings(flops, bandwidth, f"this CPU, measured: fp32 matmul {n}^3 {flops / 1e9:.1f} GFLOP/s, "
                                      f"copy {bandwidth / 1e9:.1f} GB/s")


def roofline_time(flops: float, nbytes: float, c: Ceilings) -> float:
    """The least time the work can take: its FLOPs at the matmul rate or its bytes at the copy bandwidth."""
    return max(flops / c.flops, nbytes / c.bandwidth)
