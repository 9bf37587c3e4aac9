"""Two RMSNorms of one row's two slices in one kernel (op ``rms_norm_pair``, inference).

Gated MLA normalizes both low-rank projections of each token that its stacked GEMM computes side by side: the
query's ``q_a`` (q_lora_rank wide) and the latent ``c`` (kv_lora_rank wide), each with its own weight; in a decode
step those are two launches of the RMSNorm kernel (k3.ops.rms_norm) for a handful of rows. Here program (n, s) norms
row n of slice s (0: the first input, 1: the second), both read through their row strides (views of the stacked
output), with the model's roundings (k3.model.common.RMSNorm: an fp32 input and weight as one fp32 expression, any
other input normalized in fp32, rounded to its dtype, times the weight, rounded again). Forward only: training keeps
the two norms (their backward), and the layer asks for this op only without gradients.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, dispatch, register
from k3.ops.rms_norm import rms_norm_definition

__all__ = ["rms_norm_pair", "rms_norm_pair_any", "rms_norm_pair_triton"]

tl = None  # triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
_SUM = None


def rms_norm_pair(a: Tensor, wa: Tensor, eps_a: float, b: Tensor, wb: Tensor, eps_b: float) -> tuple[Tensor, Tensor]:
    """The definition: (RMSNorm(a) with weight wa, RMSNorm(b) with weight wb), each as k3.model.common.RMSNorm."""
    return rms_norm_definition(a, wa, eps_a), rms_norm_definition(b, wb, eps_b)


def _pair_kernel(a_ptr, wa_ptr, ya_ptr, b_ptr, wb_ptr, yb_ptr, stride_a, stride_b, DA, DB, eps_a, eps_b,
                 BLOCK: tl.constexpr, FP32: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        x_ptr, w_ptr, y_ptr, stride, D, eps = a_ptr, wa_ptr, ya_ptr, stride_a, DA, eps_a
    else:
        x_ptr, w_ptr, y_ptr, stride, D, eps = b_ptr, wb_ptr, yb_ptr, stride_b, DB, eps_b
    m = cols < D
    x = tl.load(x_ptr + n * stride + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, _SUM) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if FP32:
        y = x * rstd * w
    else:
        y = w * (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + n * D + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_pair_kernel)


def _rows(x: Tensor, name: str) -> Tensor:
    """x [..., D] as [N, D] rows with unit column stride (a view where it can be)."""
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_pair_triton(a: Tensor, wa: Tensor, eps_a: float, b: Tensor, wb: Tensor,
                         eps_b: float) -> tuple[Tensor, Tensor]:
    """`rms_norm_pair` as one Triton kernel (module docstring): a [..., DA] and b [..., DB] with the same leading
    shape and dtype, weights [DA], [DB]; outputs contiguous, in the inputs' dtype. Forward only."""
    for name, x, w in (("a", a, wa), ("b", b, wb)):
        if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor")
        if not isinstance(w, Tensor) or w.shape != (x.shape[-1],) or not w.dtype.is_floating_point:
            raise ValueError(f"the weight of {name} must be a floating [{x.shape[-1]}] tensor, got "
                             f"{tuple(getattr(w, 'shape', ()))}")
    if a.shape[:-1] != b.shape[:-1] or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share their leading shape, dtype and device, got {tuple(a.shape)} "
                         f"{a.dtype} {a.device} and {tuple(b.shape)} {b.dtype} {b.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, wa, wb)):
        raise RuntimeError("the paired RMSNorm kernel has no backward: call it without gradients")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the paired RMSNorm kernel cannot run: {why}")
    a2, b2 = _rows(a, "a"), _rows(b, "b")
    N, DA, DB = a2.shape[0], a2.shape[1], b2.shape[1]
    ya = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    yb = torch.empty(b.shape, device=b.device, dtype=b.dtype)
    if N and DA and DB:
        fp32 = a.dtype == torch.float32
        if fp32 and (wa.dtype != torch.float32 or wb.dtype != torch.float32):
            raise ValueError("fp32 inputs take fp32 weights in the paired RMSNorm kernel")
        with torch.cuda.device(a.device.index if a.is_cuda else -1):  # the tensors' GPU; -1: no-op
            _kernel(_triton.interpret())[(N, 2)](
                a2, wa.contiguous(), ya, b2, wb.contiguous(), yb, a2.stride(0), b2.stride(0), DA, DB,
                float(eps_a), float(eps_b), BLOCK=1 << (max(DA, DB) - 1).bit_length(), FP32=fp32,
                num_warps=4 if max(DA, DB) <= 2048 else 8)
    return ya, yb


register(Op(
    "rms_norm_pair", reference=rms_norm_pair,
    # validated: its GPU test (tests/ops/test_rms_norm_pair.py, marked gpu) passed on an H100 (2026-12-06, fourth run)
    fast=(Fast("triton", rms_norm_pair_triton, _triton.available, validated=True, cpu=True),),
    tolerance="each output as the RMSNorm op's: fp32 1e-6 (the sum of squares in another order), bf16 one bf16 step "
              "(2^-7; both round the same fp32 values), two in the interpreter (it truncates)"))


def rms_norm_pair_any(a: Tensor, wa: Tensor, eps_a: float, b: Tensor, wb: Tensor, eps_b: float,
                      backends: Backends | None = None) -> tuple[Tensor, Tensor]:
    """`rms_norm_pair` on the implementation the registry picks (op ``rms_norm_pair``); with gradients enabled the
    definition (the kernel has no backward)."""
    if torch.is_grad_enabled():
        return rms_norm_pair(a, wa, eps_a, b, wb, eps_b)
    return dispatch("rms_norm_pair", a, backends).fn(a, wa, eps_a, b, wb, eps_b)
