"""An AttnRes site and the RMSNorm after it as one kernel, with the stream's pending add (forwards without gradients).

In a decoder layer every AttnRes site (k3.ops.attn_res) is followed by the sublayer's input norm, and the sublayer's
output is added to the stream's running partial sum just before the next site reads it (k3.model.attn_res):

    last = partial + out                         the add the stream keeps pending until the next site
    h    = attn_res(blocks + [last], w, eps)     the depth mix
    y    = RMSNorm(h)                            the sublayer's input norm (the model's definition,
                                                 k3.model.common.RMSNorm)

Composed, a site is three kernels on a GPU (the add, fla-core's mix, the norm), each a pass over the rows; here one
Triton program per row reads every source once, writes the new partial sum `last` and the normed `y` and nothing
else (h itself is only the norm's input; the output site, which has no norm after it, returns h). The mix is an
online softmax over the sources in their order; roundings are the composition's: `last` rounded once to the
sources' dtype (as PyTorch's add), h rounded to it, then the norm's x_hat and product each rounded (the release's
RMSNorm; for fp32 activations and weight the roundings are no-ops and the norm is ``F.rms_norm``'s).

For inference forwards only: the kernel has no backward (training runs fla-core's differentiable mix and the norm
kernel). This is op ``attn_res_norm`` of k3.ops.registry: `attn_res_norm` (the reference, the composition written
out) and `attn_res_norm_triton`; the stream asks the registry once per forward (k3.model.attn_res).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import _triton
from k3.ops.attn_res import attn_res
from k3.ops.registry import Backends, Fast, Impl, Op, dispatch, register
from k3.ops.rms_norm import rms_norm_reference

__all__ = ["MAX_SOURCES", "attn_res_norm", "attn_res_norm_impl", "attn_res_norm_triton"]

MAX_SOURCES = 32  # the kernel's source table is padded to a power of two up to this (K3: 8 blocks + 2 at most)

tl = None  # triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
_SUM = None


def _check(sources: Sequence[Tensor], w: Tensor, norm_weight: Tensor | None, add: Tensor | None) -> None:
    """Every error names the argument, what it got and what it needs."""
    if not isinstance(sources, (list, tuple)) or not sources:
        raise ValueError("sources must be a non-empty list of tensors [..., D]")
    first = sources[0]
    for i, s in enumerate(sources):
        if not isinstance(s, Tensor) or s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            got = f"{tuple(s.shape)} {s.dtype} on {s.device}" if isinstance(s, Tensor) else type(s).__name__
            raise ValueError(f"sources[{i}] must be a tensor of shape {tuple(first.shape)}, dtype {first.dtype} on "
                             f"{first.device} like sources[0], got {got}")
    if first.ndim < 1 or not first.dtype.is_floating_point:
        raise ValueError(f"sources must be floating tensors [..., D], got {tuple(first.shape)} {first.dtype}")
    D = first.shape[-1]
    if not isinstance(w, Tensor) or w.shape != (D,):
        raise ValueError(f"w must have shape [{D}] (the site query), got "
                         f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
    if norm_weight is not None and (not isinstance(norm_weight, Tensor) or norm_weight.shape != (D,)):
        got = tuple(norm_weight.shape) if isinstance(norm_weight, Tensor) else type(norm_weight).__name__
        raise ValueError(f"norm_weight must have shape [{D}], got {got}")
    if add is not None and (not isinstance(add, Tensor) or add.shape != first.shape or add.dtype != first.dtype):
        got = f"{tuple(add.shape)} {add.dtype}" if isinstance(add, Tensor) else type(add).__name__
        raise ValueError(f"add must have the sources' shape {tuple(first.shape)} and dtype {first.dtype}, got {got}")


def _norm(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm (k3.model.common.RMSNorm) of h, without a backend choice."""
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(h, (h.shape[-1],), weight, eps=eps)
    return rms_norm_reference(h, weight, eps)


def attn_res_norm(sources: Sequence[Tensor], w: Tensor, eps: float, norm_weight: Tensor | None = None,
                  norm_eps: float = 1e-5, add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One AttnRes site (the module docstring): the depth mix of `sources` (the completed blocks, then the running
    partial sum), all [..., D] of one dtype, with the site query `w` [D] fp32, the partial sum first advanced by
    `add` (the last sublayer's output, or None), then the RMSNorm of weight `norm_weight` [D] (None: no norm, the
    output site). Returns (y, the partial sum after the add, a new tensor or sources[-1] itself)."""
    _check(sources, w, norm_weight, add)
    last = sources[-1] if add is None else sources[-1] + add
    h = attn_res(list(sources[:-1]) + [last], w, eps)
    return (h if norm_weight is None else _norm(h, norm_weight, norm_eps)), last


def _kernel(src, add_ptr, last_ptr, w_ptr, nw_ptr, y_ptr, D, eps, norm_eps, L: tl.constexpr, HAS_ADD: tl.constexpr,
            HAS_NORM: tl.constexpr, BD: tl.constexpr):
    """Program r: row r of every source (src: a table of L row-major [N, D] pointers, padded), online softmax over
    them, then the norm; `last` written when there is an add."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < D
    off = r * D + cols
    wq = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    acc = wq * 0.0  # the online softmax's accumulator, denominator and running max (tl.zeros is not callable in
    den = tl.reduce(acc, 0, _SUM)  # the interpreter); exp(-inf) = 0 makes the first source's step a plain start
    mx = den - float("inf")
    for i in tl.static_range(L):
        v = tl.load(src[i] + off, mask=m, other=0.0)
        if HAS_ADD and i == L - 1:  # the pending add, rounded once to the sources' dtype, as PyTorch's add
            v = (v.to(tl.float32) + tl.load(add_ptr + off, mask=m, other=0.0).to(tl.float32)).to(
                last_ptr.dtype.element_ty)
            tl.store(last_ptr + off, v, mask=m)
        v = v.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.reduce(v * v, 0, _SUM) / D + eps)
        s = tl.reduce(v * rstd * wq, 0, _SUM)
        new = tl.maximum(mx, s)
        a = tl.exp(mx - new)
        b = tl.exp(s - new)
        acc = acc * a + v * b
        den = den * a + b
        mx = new
    h = (acc / den).to(y_ptr.dtype.element_ty)
    if HAS_NORM:
        h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.reduce(h * h, 0, _SUM) / D + norm_eps)
        xh = (h * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=m, other=0.0).to(tl.float32)
        h = (nw * xh).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + off, h, mask=m)


@functools.lru_cache(maxsize=2)
def _jit(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_kernel)


def attn_res_norm_triton(sources: Sequence[Tensor], w: Tensor, eps: float, norm_weight: Tensor | None = None,
                         norm_eps: float = 1e-5, add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`attn_res_norm` as one Triton kernel (the module docstring); the same arguments and results. Forward only."""
    _check(sources, w, norm_weight, add)
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"the attn_res_norm kernel takes at most {MAX_SOURCES} sources, got {len(sources)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*sources, w, norm_weight, add)
                                       if isinstance(t, Tensor)):
        raise RuntimeError("the attn_res_norm kernel has no backward: call it without gradients (inference forwards)")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the attn_res_norm kernel cannot run: {why}")
    first = sources[0]
    shape, D = first.shape, first.shape[-1]
    rows = [s.reshape(-1, D) for s in sources]
    rows = [r if r.is_contiguous() else r.contiguous() for r in rows]
    N = rows[0].shape[0]
    y = torch.empty(shape, device=first.device, dtype=first.dtype)
    last = sources[-1] if add is None else torch.empty(shape, device=first.device, dtype=first.dtype)
    addr = rows[-1] if add is None else add.reshape(-1, D).contiguous()
    # the table's length is part of the kernel's signature: padded to a power of two (the pads are never read)
    n = max(2, 1 << (len(rows) - 1).bit_length())
    table = tuple(rows) + (rows[0],) * (n - len(rows))
    block = 1 << max(D - 1, 1).bit_length()
    if N:
        with torch.cuda.device(first.device.index if first.is_cuda else -1):
            _jit(_triton.interpret())[(N,)](
                table, addr, last, w.float().contiguous(), w if norm_weight is None else norm_weight.contiguous(), y,
                D, float(eps), float(norm_eps), L=len(rows), HAS_ADD=add is not None, HAS_NORM=norm_weight is not None,
                BD=block, num_warps=4 if block <= 1024 else 8)
    return y, last


register(Op(
    "attn_res_norm", reference=attn_res_norm,
    # validated: its GPU tests (tests/ops/test_attn_res_norm.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", attn_res_norm_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32: 1e-5 of the largest entry (the softmax online, sums in another order); bf16: one bf16 step of "
              "y (h and x_hat round the same fp32 values up to those sums), two in the interpreter (it truncates); "
              "the new partial sum equal to the reference's add (one rounding of the same fp32 sum), within one bf16 "
              "step in the interpreter"))


def attn_res_norm_impl(where: Tensor, backends: Backends | None = None) -> Impl:
    """The implementation of op ``attn_res_norm`` the registry picks for sources like `where`."""
    return dispatch("attn_res_norm", where, backends)
