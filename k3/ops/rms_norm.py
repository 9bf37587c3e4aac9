"""RMSNorm of bf16/fp16 activations with an fp32 weight (training) or a weight of the activations' dtype (a served
bf16 model), forward and backward as one Triton kernel each.

The model's RMSNorm (``k3.model.common.RMSNorm``, the release's form) on a bf16 input is

    x_hat = bf16(x * rsqrt(mean(x^2) + eps))      computed in fp32, rounded back to the input dtype
    y     = bf16(weight * x_hat)                  fp32 weight, product rounded to the input dtype

(with a bf16 weight the product of two bf16 values is exact in fp32, so rounding it once gives what the bf16
multiply gives: one kernel covers both), which in PyTorch is a cast, the fused norm, a cast, a multiply and a cast
forward (four kernels per norm in every decode step of a served model), and as many kernels backward
plus a reduction for the weight's gradient. Here the forward reads x once and writes y and the per-row rstd; the
backward reads x, dy and rstd once and writes dx and per-program partial sums of d(weight), with the same roundings
as autograd's: d(x_hat) = bf16(dy * weight) (the multiply's gradient with respect to a bf16 input), then the fp32
norm backward
``dx = rstd * (g - x_hat * mean(g * x_hat))`` rounded to the input dtype, and d(weight) = sum over rows of
``dy * x_hat`` in fp32.

This is op ``rms_norm`` (fast implementation ``triton``) of k3.ops.registry; :func:`rms_norm_any` picks it or the
reference.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["rms_norm_any", "rms_norm_definition", "rms_norm_reference", "rms_norm_triton"]

_ROWS = 64  # rows per program in the backward (partial weight-gradient sums: one [D] row per program)
tl = None  # triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
_SUM = None


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The definition (what ``k3.model.common.RMSNorm`` computes for an input that is not fp32)."""
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (weight * y.to(x.dtype)).to(x.dtype)


def rms_norm_definition(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """What ``k3.model.common.RMSNorm`` computes for any input: an fp32 input with an fp32 weight as one fp32
    expression, anything else as :func:`rms_norm_reference` (the reference side of the fused kernels that end in
    this norm)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return rms_norm_reference(x, weight, eps)


def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, D, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + r * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, _SUM) / D + eps)
    xh = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * stride_y + cols, (w * xh).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + r, rstd)


def _bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, stride_x, stride_dy, stride_dx, D,
                ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    dw = w * 0.0  # (tl.zeros is not callable in the interpreter)
    for i in range(ROWS):
        r = pid * ROWS + i
        # The row test as a block (cols * 0 + r), and the last row's rstd read for rows past the end (their
        # stores are masked): Triton's interpreter rejects a scalar boolean in a mask.
        mr = m & (cols * 0 + r < n_rows)
        x = tl.load(x_ptr + r * stride_x + cols, mask=mr, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(r, n_rows - 1))
        dy = tl.load(dy_ptr + r * stride_dy + cols, mask=mr, other=0.0).to(tl.float32)
        xh = x * rstd
        dw += dy * xh.to(dx_ptr.dtype.element_ty).to(tl.float32)
        g = (dy * w).to(dx_ptr.dtype.element_ty).to(tl.float32)
        dx = rstd * (g - xh * (tl.reduce(g * xh, 0, _SUM) / D))
        tl.store(dx_ptr + r * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mr)
    tl.store(dw_ptr + pid * D + cols, dw, mask=m)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    import triton

    _triton.bind(globals())  # _SUM: tl.sum is a jit function the interpreter cannot call from here
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n = x2.shape[0]
        y = torch.empty((n, D), device=x.device, dtype=x.dtype)
        rstd = torch.empty(n, device=x.device, dtype=torch.float32)
        block = 1 << max(D - 1, 1).bit_length()
        if n:
            with torch.cuda.device(x.device.index if x.is_cuda else -1):
                _kernels(_triton.interpret())[0][(n,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), D, eps,
                                                BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n, D = x2.shape
        dy2 = dy.reshape(n, D)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, -(-n // _ROWS))
        partial = torch.empty((programs, D), device=x2.device, dtype=torch.float32)
        block = 1 << max(D - 1, 1).bit_length()
        if n:
            with torch.cuda.device(x2.device.index if x2.is_cuda else -1):
                _kernels(_triton.interpret())[1][(programs,)](x2, weight, dy2, rstd, dx, partial, n, x2.stride(0),
                                                       dy2.stride(0), dx.stride(0), D, ROWS=_ROWS, BLOCK=block,
                                                       num_warps=_warps(block))
        else:
            partial.zero_()
        dw = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dw, None


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:func:`rms_norm_reference` as one Triton kernel forward and one backward (x bf16/fp16, weight [D] fp32 or of
    x's dtype; the weight's gradient in the weight's dtype)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"the RMSNorm kernel takes bf16/fp16 x and an fp32 weight or one of x's dtype, got {x.dtype} "
                         f"and {weight.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the RMSNorm kernel cannot run: {why}")
    return _RMSNorm.apply(x, weight, float(eps))


register(Op(
    "rms_norm", reference=rms_norm_reference,
    fast=(Fast("triton", rms_norm_triton, _triton.available, validated=True),),
    tolerance="output and input gradient one bf16 step, 2^-7 (both sides round the same fp32 values; the norm's sum "
              "runs in another order), two in the interpreter (it truncates); the weight's gradient 1e-4 (fp32 sums "
              "over rows in another order), 1e-2 in the interpreter; a bf16 weight's gradient one bf16 step (the "
              "reference sums it in bf16)"))


def rms_norm_any(x: Tensor, weight: Tensor, eps: float, backends: Backends | None = None) -> Tensor:
    """:func:`rms_norm_reference` on the implementation the registry picks (op ``rms_norm``) for a bf16/fp16 x and
    an fp32 weight or one of x's dtype; the reference for anything else (the kernel's domain)."""
    if x.dtype in (torch.bfloat16, torch.float16) and weight.dtype in (torch.float32, x.dtype):
        return dispatch("rms_norm", x, backends).fn(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
