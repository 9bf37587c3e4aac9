"""A kernel-optimization task (report §4.2.4): what a candidate `kernel(...)` must compute, on which inputs it is
checked and timed, how close it must be, whom it is measured against, and how fast the hardware could do it.

Inputs are a pure function of (shape, seed, magnitude, device): the candidate's process and the harness's process
build the same tensors independently, so the reference never runs where the candidate runs, and every call can get
fresh inputs that the harness can still check afterwards.

Magnitudes: "normal" (the task's realistic distribution), "large" and "small" (adversarial: overflow in fp16 or
in an unshifted exp, loss of precision in fp16's subnormals, eps dominating a norm) and "precision" (well-
conditioned inputs on which bf16, fp16 or TF32 arithmetic misses an fp32 tolerance; fp32 tasks only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor

__all__ = ["Case", "Task", "Tolerance", "cases", "compare", "generator", "randn"]

Shape = Mapping[str, int]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise |out - ref| <= rtol |ref| + atol max|ref| (atol relative to the output's largest entry), with
    the reason these bounds are right for the task."""

    rtol: float
    atol: float
    why: str


@dataclass(frozen=True)
class Case:
    """One call's inputs: `label` says why it is there (benchmark, held-out, large, small, precision, and the
    detectors' fresh / mutated / timed calls)."""

    label: str
    shape: Mapping[str, int]
    seed: int
    magnitude: str = "normal"

    def describe(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"{self.label} case (shape {dims}; seed {self.seed}; magnitude {self.magnitude})"

    def to_dict(self) -> dict:
        return {"label": self.label, "shape": dict(self.shape), "seed": self.seed, "magnitude": self.magnitude}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Case":
        return cls(d["label"], dict(d["shape"]), int(d["seed"]), d["magnitude"])


@dataclass(frozen=True)
class Task:
    """A task. `make(shape, seed, magnitude, device)` returns the kernel's arguments; `reference(*args)` the
    expected outputs in float64 (a tensor or a tuple); `out_dtypes` the dtypes the candidate must return.

    bench / bench_cpu: the timed shape on CUDA / on CPU; held_out: shapes only checked (odd sizes, edge cases).
    flops / bytes: the work of one call at a shape (bytes: compulsory reads + writes), for the roofline.
    experts: device type ("cuda", "cpu") -> "module:function", the expert a reward of 0.5 stands for (fla's or our
    kernel on CUDA, the reference or our torch op on CPU); variants: more named implementations the benchmark
    scores ("ours", "naive"). precision: the tolerance of the "precision" case (fp32 tasks). forbidden: functions
    a candidate may not call (the expert's kernels and the reference)."""

    name: str
    signature: str
    make: Callable[..., tuple]
    reference: Callable[..., Tensor | tuple]
    out_dtypes: tuple[torch.dtype, ...]
    tolerance: Tolerance
    bench: Shape
    bench_cpu: Shape
    held_out: tuple[Shape, ...]
    flops: Callable[[Shape], float]
    bytes: Callable[[Shape], float]
    experts: Mapping[str, str]
    variants: Mapping[str, str] = field(default_factory=dict)
    precision: Tolerance | None = None
    forbidden: tuple[str, ...] = ()
    seeds: int = 2

    def bench_shape(self, device: str) -> Shape:
        return self.bench if device == "cuda" else self.bench_cpu

    def expert(self, device: str) -> str:
        return self.experts.get(device, self.experts["cpu"])


def cases(task: Task, device: str) -> list[Case]:
    """The correctness cases: the benchmark shape with `task.seeds` seeds, every held-out shape, the large and
    small magnitudes on the first and last held-out shapes, and the precision case where the task has one."""
    bench = task.bench_shape(device)
    out = [Case("benchmark", bench, s) for s in range(task.seeds)]
    out += [Case("held-out", s, 100 + i) for i, s in enumerate(task.held_out)]
    out += [Case("large", task.held_out[0], 200, "large"), Case("small", task.held_out[-1], 201, "small"),
            Case("large", bench, 202, "large")]
    if task.precision is not None:
        out.append(Case("precision", bench, 300, "precision"))
    return out


def generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(g: torch.Generator, *size: int, device, dtype=torch.float32, scale: float = 1.0) -> Tensor:
    """Normal values drawn in fp32 on `device`, scaled, then cast (the same values on every call with `g`'s seed)."""
    x = torch.randn(*size, generator=g, device=device, dtype=torch.float32)
    return (x * scale).to(dtype)


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def compare(out: Tensor, ref: Tensor, dtype: torch.dtype, tol: Tolerance) -> str | None:
    """None when `out` matches `ref` (float64) within `tol`, else what is wrong (shape, dtype, non-finite values or
    the worst entry)."""
    if not isinstance(out, Tensor):
        return f"returned a {type(out).__name__}, expected a tensor"
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if out.dtype != dtype:
        return f"dtype {out.dtype}, expected {dtype}"
    if ref.numel() == 0:
        return None
    o, r = out.detach().to(device=ref.device, dtype=torch.float64), ref
    bad_finite = torch.isfinite(r) & ~torch.isfinite(o)
    if bad_finite.any():
        i = tuple(int(j) for j in bad_finite.nonzero()[0])
        return f"non-finite value {o[i].item()} at index {i} where the reference is {r[i].item():.6g}"
    bound = tol.rtol * r.abs() + tol.atol * r.abs().max()
    excess = (o - r).abs() - bound
    if (excess > 0).any():
        i = tuple(int(j) for j in torch.unravel_index(excess.argmax(), r.shape))
        err = (o[i] - r[i]).abs().item()
        return (f"error {err:.3g} at index {i} (got {o[i].item():.6g}, expected {r[i].item():.6g}) exceeds the "
                f"tolerance {bound[i].item():.3g} (rtol {tol.rtol:g}, atol {tol.atol:g} x max|ref|)")
    return None


def relative_error(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), for the precision detector's error profile."""
    o = out.detach().to(device=ref.device, dtype=torch.float64)
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))
