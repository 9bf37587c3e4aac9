"""Per-Head Muon's elementwise passes as two Triton kernels (op ``muon`` of k3.ops.registry).

Around its Newton-Schulz GEMMs, a Muon step moves every parameter's bytes several times. With PyTorch ops:

* momentum: ``buf *= mu; buf += g`` (two passes over fp32 buf), then the Newton-Schulz input
  ``u = g + mu * buf`` (Nesterov) or ``u = buf``, rounded into the NS dtype: 30 bytes per parameter;
* update: ``p *= 1 - lr * wd`` and ``p += alpha * o`` (two passes over fp32 p), where o, the orthogonalized
  block, is a transposed view for tall blocks and is first copied contiguous: 18-22 bytes per parameter.

:func:`momentum_` does the first in one pass (reads g and buf, writes buf and u: 14 bytes with a bf16 u) and
:func:`decay_add_` the second (reads p and o, writes p: 10 bytes), taking o's strides as they are. For k3-mini's
2.2B parameters that is ~55 GB less traffic per optimizer step. Both compute in fp32. The results equal the
PyTorch passes up to the rounding of one fused multiply-add instead of a multiply and an add.

The kernels are not validated for ``auto``: they measured no faster than the PyTorch passes (BENCHMARKS.md), so
``auto`` keeps the reference and ``per_op={"muon": "triton"}`` (or ``fast``) asks for them. Triton is imported
lazily (k3.ops._triton); ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors in Triton's interpreter (tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, Target, register, runs_on

__all__ = ["decay_add_", "decay_add_torch", "fused", "momentum_", "momentum_torch", "newton_schulz_input_torch"]

_BLOCK = 2048  # elements per program of the momentum kernel
_BLOCK_R, _BLOCK_C = 32, 64  # tile of the update kernel
tl = None  # triton.language, bound on first use (k3.ops._triton.bind)


def momentum_torch(g: Tensor, buf: Tensor, u: Tensor, mu: float, nesterov: bool) -> None:
    """Reference: buf <- mu * buf + g; u <- g + mu * buf (Nesterov) or buf, in u's dtype."""
    buf.mul_(mu).add_(g)
    newton_schulz_input_torch(g, buf, u, mu, nesterov)


def newton_schulz_input_torch(g: Tensor, buf: Tensor, u: Tensor, mu: float, nesterov: bool) -> None:
    """u <- g + mu * buf (Nesterov) or buf, rounded once into u's dtype (buf already updated)."""
    if nesterov:
        torch.add(g, buf, alpha=mu, out=u)
    else:
        u.copy_(buf)


def decay_add_torch(p: Tensor, o: Tensor, decay: float, alpha: float) -> None:
    """Reference: p <- decay * p + alpha * o (o of p's shape, any strides)."""
    if decay != 1.0:
        p.mul_(decay)
    p.add_(o.reshape(p.shape), alpha=alpha)


def _momentum_kernel(g_ptr, b_ptr, u_ptr, n, mu, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = mu * b + g
    tl.store(b_ptr + offs, b.to(b_ptr.dtype.element_ty), mask=m)
    if NESTEROV:
        u = g + mu * b
    else:
        u = b
    tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=m)


def _decay_add_kernel(p_ptr, o_ptr, R, C, so0, so1, so2, decay, alpha,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Block b = program 0 of the [n, R, C] parameter view (contiguous), one [BLOCK_R, BLOCK_C] tile of it."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    pp = p_ptr + b * R * C + r64 * C + c64
    o = tl.load(o_ptr + b * so0 + r64 * so1 + c64 * so2, mask=m, other=0.0).to(tl.float32)
    p = tl.load(pp, mask=m, other=0.0).to(tl.float32)
    tl.store(pp, (decay * p + alpha * o).to(p_ptr.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The jitted kernels, one pair per interpreter setting (``triton.jit`` decides compiled or interpreted)."""
    import triton

    _triton.bind(globals())
    return triton.jit(_momentum_kernel), triton.jit(_decay_add_kernel)


def _check_runnable(t: Tensor) -> None:
    ok, why = _triton.available(Target(t.device))
    if not ok:
        raise RuntimeError(f"the Muon update kernels cannot run: {why}")


def momentum_(g: Tensor, buf: Tensor, u: Tensor, mu: float, nesterov: bool) -> None:
    """:func:`momentum_torch` in one pass. g, buf and u: contiguous, the same number of elements (any shapes)."""
    n = buf.numel()
    if g.numel() != n or u.numel() != n:
        raise ValueError(f"g, buf and u must have the same number of elements, got {g.numel()}, {n}, {u.numel()}")
    if not (g.is_contiguous() and buf.is_contiguous() and u.is_contiguous()):
        raise ValueError("g, buf and u must be contiguous (the kernel walks them as flat arrays)")
    _check_runnable(buf)
    if n == 0:
        return
    kernel = _kernels(_triton.interpret())[0]
    with torch.cuda.device(buf.device.index if buf.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        kernel[(-(-n // _BLOCK),)](g, buf, u, n, float(mu), NESTEROV=bool(nesterov), BLOCK=_BLOCK, num_warps=4)


def decay_add_(p: Tensor, o: Tensor, decay: float, alpha: float) -> None:
    """:func:`decay_add_torch` in one pass. p: [n, R, C] contiguous (a parameter's block view); o: [n, R, C],
    any strides (e.g. the transposed view Newton-Schulz returns for tall blocks)."""
    if p.ndim != 3 or tuple(o.shape) != tuple(p.shape):
        raise ValueError(f"p must be [n, R, C] and o the same shape, got {tuple(p.shape)} and {tuple(o.shape)}")
    if not p.is_contiguous():
        raise ValueError("p must be contiguous")
    _check_runnable(p)
    n, R, C = p.shape
    if p.numel() == 0:
        return
    kernel = _kernels(_triton.interpret())[1]
    grid = (n, -(-R // _BLOCK_R), -(-C // _BLOCK_C))
    with torch.cuda.device(p.device.index if p.is_cuda else -1):
        kernel[grid](p, o, R, C, *o.stride(), float(decay), float(alpha), BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
                     num_warps=4)


register(Op(
    "muon", reference=momentum_torch,
    fast=(Fast("triton", momentum_, _triton.available, validated=False, cpu=True),),
    tolerance="fp32: 1e-6 relative (one fused multiply-add instead of a multiply and an add); a bf16 "
              "Newton-Schulz input one bf16 step, 2^-7 (with decay_add_torch / decay_add_ as the update pass)"))


def fused(device: torch.device, backends: Backends | None = None) -> bool:
    """Whether Per-Head Muon runs its momentum and update passes on these kernels for parameters on `device`
    (op ``muon``: ``momentum_`` and ``decay_add_``), rather than the PyTorch passes."""
    return runs_on("muon", "triton", Target(device), backends)
