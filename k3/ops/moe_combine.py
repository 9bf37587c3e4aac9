"""The latent MoE's combine step: each token's k expert outputs, weighted by its routing weights, summed.

After the grouped GEMMs, the expert outputs ``y`` [N*k, L] sit in expert order; ``pos`` [N*k] gives the row of
``y`` that holds (token n, slot j) (row n*k + j of ``pos``), and

    u[n] = sum_j weights[n, j] * y[pos[n*k + j]]        (fp32 arithmetic, u stored in `out_dtype`)

The PyTorch form (:func:`moe_combine_torch`, the reference) gathers ``y`` back into token order, upcasts it to
fp32, multiplies and sums: four passes over an [N, k, L] tensor, two of them in fp32. The Triton kernel
(:func:`moe_combine_triton`) reads each row of ``y`` once and writes ``u`` once; its backward reads ``y`` and
``du`` once, writes d(y) in the same expert order (every row of ``y`` belongs to exactly one (token, slot), so no
atomics) and reduces d(weights)[n, j] = <du[n], y[pos[n*k + j]]> in fp32 in the same pass.

:func:`moe_combine` picks the implementation through k3.ops.registry (op ``moe_combine``). Triton is imported
lazily (k3.ops._triton); ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors in Triton's interpreter (tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["moe_combine", "moe_combine_torch", "moe_combine_triton", "moe_dispatch"]

_MAX_BLOCK_L = 512
# triton.language and the sum combine function, bound on first use (k3.ops._triton.bind: the kernel calls only
# Triton builtins, tl.reduce with _SUM)
tl = None
_SUM = None


def _check(y: Tensor, pos: Tensor, weights: Tensor) -> None:
    if weights.ndim != 2 or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be a floating [N, k] tensor, got shape {tuple(weights.shape)}")
    N, k = weights.shape
    if y.ndim != 2 or y.shape[0] != N * k:
        raise ValueError(f"y must have shape [N*k={N * k}, L], got {tuple(y.shape)}")
    if pos.shape != (N * k,) or pos.dtype.is_floating_point:
        raise ValueError(f"pos must be an integer tensor of shape [{N * k}], got {tuple(pos.shape)} {pos.dtype}")


def moe_combine_torch(y: Tensor, pos: Tensor, weights: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Reference: gather y into (token, slot) order, weight in fp32, sum over the k slots."""
    _check(y, pos, weights)
    N, k = weights.shape
    u = (y[pos].view(N, k, y.shape[1]).float() * weights.float()[:, :, None]).sum(dim=1)
    return u.to(out_dtype)


def _combine_kernel(y_ptr, pos_ptr, w_ptr, u_ptr, du_ptr, dy_ptr, dw_ptr, stride_y, stride_u, L: tl.constexpr,
                    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_L: tl.constexpr, BACKWARD: tl.constexpr):
    """Program n: token n's k rows of y, over L in BLOCK_L columns. Forward: u[n] = sum_j w[n, j] y[pos[n, j]].
    BACKWARD: dy[pos[n, j]] = w[n, j] du[n] and dw[n, j] = <du[n], y[pos[n, j]]>, fp32 throughout."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    jm = j < K
    rows = tl.load(pos_ptr + n * K + j, mask=jm, other=0).to(tl.int64)  # [K_PAD] rows of y
    w = tl.load(w_ptr + n * K + j, mask=jm, other=0.0).to(tl.float32)
    dw = tl.full([K_PAD], 0.0, tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        m2 = jm[:, None] & cm[None, :]
        yv = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        if BACKWARD:
            g = tl.load(du_ptr + n * stride_u + cols, mask=cm, other=0.0).to(tl.float32)
            dw += tl.reduce(yv * g[None, :], 1, _SUM)
            tl.store(dy_ptr + rows[:, None] * stride_y + cols[None, :],
                     (w[:, None] * g[None, :]).to(dy_ptr.dtype.element_ty), mask=m2)
        else:
            acc = tl.reduce(yv * w[:, None], 0, _SUM)
            tl.store(u_ptr + n * stride_u + cols, acc.to(u_ptr.dtype.element_ty), mask=cm)
    if BACKWARD:
        tl.store(dw_ptr + n * K + j, dw, mask=jm)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_combine_kernel)


def _launch(y, pos, w, *, u=None, du=None, dy=None, dw=None) -> None:
    """Forward (u given) or backward (du, dy, dw given); y, u, du row-major with unit column stride."""
    N, k = w.shape
    L = y.shape[1]
    if N == 0 or L == 0:
        return
    block = min(_MAX_BLOCK_L, 1 << (L - 1).bit_length())
    k_pad = 1 << (k - 1).bit_length()
    stride_u = (u if u is not None else du).stride(0)
    with torch.cuda.device(y.device.index if y.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        _kernel(_triton.interpret())[(N,)](y, pos, w, u, du, dy, dw, y.stride(0), stride_u, L=L,
                                    K=k, K_PAD=k_pad, BLOCK_L=block, BACKWARD=u is None, num_warps=4)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, pos: Tensor, weights: Tensor, out_dtype: torch.dtype) -> Tensor:
        N, _ = weights.shape
        u = torch.empty(N, y.shape[1], device=y.device, dtype=out_dtype)
        _launch(y, pos, weights, u=u)
        ctx.save_for_backward(y, pos, weights)
        return u

    @staticmethod
    def backward(ctx, du: Tensor):
        y, pos, weights = ctx.saved_tensors
        du = du.contiguous()
        dy = torch.empty_like(y)
        dw = torch.empty(weights.shape, device=y.device, dtype=torch.float32)
        _launch(y, pos, weights, du=du, dy=dy, dw=dw)
        return dy, None, dw.to(weights.dtype), None


def moe_combine_triton(y: Tensor, pos: Tensor, weights: Tensor, out_dtype: torch.dtype) -> Tensor:
    """:func:`moe_combine_torch` as one Triton kernel forward and one backward (see the module docstring)."""
    _check(y, pos, weights)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MoE combine kernel cannot run: {why}")
    if y.stride(1) != 1:
        y = y.contiguous()
    return _Combine.apply(y, pos.contiguous(), weights.contiguous(), out_dtype)


class _Dispatch(torch.autograd.Function):
    """x = z[order // k] (each token's row once per slot, in expert order); the backward is the combine with unit
    weights, dz[n] = sum_j dx[pos[n*k + j]], in fp32 in one pass instead of a scatter into zeros and a sum."""

    @staticmethod
    def forward(ctx, z: Tensor, order: Tensor, pos: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(pos)
        ctx.k, ctx.z_dtype = k, z.dtype
        return z.index_select(0, order // k)

    @staticmethod
    def backward(ctx, dx: Tensor):
        (pos,) = ctx.saved_tensors
        N = pos.numel() // ctx.k
        ones = torch.ones(N, ctx.k, device=dx.device, dtype=torch.float32)
        dz = torch.empty(N, dx.shape[1], device=dx.device, dtype=ctx.z_dtype)
        _launch(dx.contiguous(), pos, ones, u=dz)
        return dz, None, None, None


register(Op(
    "moe_combine", reference=moe_combine_torch,
    fast=(Fast("triton", moe_combine_triton, _triton.available, validated=True),),
    tolerance="fp32: 1e-5 of the largest entry (only the order of the k-term sums differs); bf16 outputs one "
              "ulp, 2^-7 (the interpreter truncates where the compiled kernel rounds); d(weights) 1e-5 (fp32 sums)"))


def moe_dispatch(z: Tensor, order: Tensor, pos: Tensor, k: int, backends: Backends | None = None) -> Tensor:
    """The experts' input rows: x[i] = z[order[i] // k] for the N*k (token, slot) pairs sorted by expert
    (`order`; `pos` is its inverse). Where the registry picks the combine kernel (op ``moe_combine``) its backward
    is that kernel with unit weights (deterministic, fp32 sums); otherwise the same gather in PyTorch."""
    N, L = z.shape
    if order.shape != (N * k,) or pos.shape != (N * k,):
        raise ValueError(f"order and pos must have shape [N*k={N * k}], got {tuple(order.shape)}, {tuple(pos.shape)}")
    if dispatch("moe_combine", z, backends).name == "triton":
        return _Dispatch.apply(z if z.stride(1) == 1 else z.contiguous(), order, pos.contiguous(), k)
    return z[:, None, :].expand(N, k, L).reshape(N * k, L)[order]


def moe_combine(y: Tensor, pos: Tensor, weights: Tensor, out_dtype: torch.dtype,
                backends: Backends | None = None) -> Tensor:
    """The combine on the implementation the registry picks for `y` (op ``moe_combine``: the Triton kernel on
    CUDA)."""
    return dispatch("moe_combine", y, backends).fn(y, pos, weights, out_dtype)
