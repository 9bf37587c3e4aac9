"""The output head's cross-entropy, chunked over rows, with its gradient computed in the forward pass.

``linear_cross_entropy(h, weight, target)`` = ``F.cross_entropy(F.linear(h, weight).float(), target,
reduction="sum", ignore_index=-100)`` without ever holding the [N, V] logits: rows go through the head
``chunk_tokens`` at a time. When a gradient will be needed, each chunk's gradient is finished while its logits are
at hand: d(logits) = softmax - onehot (fp32, rounded to the GEMM dtype as autograd's cast would), then
d(h) = d(logits) W and d(W) += d(logits)^T h. The backward only scales those by the incoming gradient.

Against recomputing each chunk in the backward (activation checkpointing of the head), this runs three GEMMs per
chunk instead of four and reads the logits once instead of three times, with the same numbers: the logits are the
GEMM's output in its dtype (bf16 under autocast) upcast to fp32, and d(W) sums the per-chunk products rounded to
that dtype in fp32, as autograd does when it accumulates a bf16 weight gradient into an fp32 parameter.

The step between the GEMMs (log-sum-exp, the picked logit, softmax - onehot) is a chain of PyTorch passes over an
fp32 copy of the chunk's logits (about ten reads and writes of [chunk, V] in fp32). With the ``triton`` backend
(op ``linear_ce`` of k3.ops.registry) one kernel does it in place on the GEMM's output: each
row is read twice (running max and sum of exponentials, then the gradient) and written once, in the GEMM dtype,
with fp32 arithmetic as the reference. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors (tests).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["linear_cross_entropy", "ce_grad_", "ce_grad_torch_", "ce_grad_triton_"]

_BLOCK_V = 4096
# triton.language and the reduction combine functions, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None
_MAX = None


def _compute_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's, when it is on for h's device, else h's."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


def _chunk_logits(hc: Tensor, wc: Tensor) -> Tensor:
    return (hc @ wc.t()).float()


def ce_grad_torch_(logits: Tensor, target: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Reference: (summed cross-entropy of the rows of `logits` [n, V] against `target` [n] as an fp32 scalar,
    d(sum)/d(logits) = (softmax - onehot) * valid in logits' dtype). Computed in fp32, in place when `logits` is
    fp32 already (it is overwritten then, as the kernel always overwrites it), else on an upcast copy."""
    x = logits.float()
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None])[:, 0]
    total = ((lse - picked) * valid).sum()
    p = x.sub_(lse[:, None]).exp_()
    p.scatter_add_(1, safe[:, None], -torch.ones_like(picked)[:, None])
    return total, p.mul_(valid[:, None]).to(logits.dtype)


def _ce_kernel(x_ptr, t_ptr, loss_ptr, stride_x, ignore_index, V: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r of x [n, V]. loss[r] = (logsumexp(x_r) - x_r[t_r]) * valid_r, then x_r is overwritten
    with (softmax(x_r) - onehot(t_r)) * valid_r, in x's dtype; fp32 arithmetic throughout."""
    r = tl.program_id(0).to(tl.int64)
    base = x_ptr + r * stride_x
    t = tl.load(t_ptr + r).to(tl.int64)
    valid = t != ignore_index
    m = tl.full([BLOCK], -1e30, tl.float32)  # per-lane running max (finite: exp(m - m_new) never sees inf - inf)
    s = tl.full([BLOCK], 0.0, tl.float32)  # per-lane sum of exp(x - m)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    mx = tl.reduce(m, 0, _MAX)
    lse = mx + tl.log(tl.reduce(s * tl.exp(m - mx), 0, _SUM))
    safe = tl.where(valid, t, 0)
    # (labels are range-checked with the input ids by the model; the mask only keeps a bad one inside the row)
    picked = tl.load(base + safe, mask=(safe >= 0) & (safe < V), other=0.0).to(tl.float32)
    tl.store(loss_ptr + r, tl.where(valid, lse - picked, 0.0))
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        cm = cols < V
        x = tl.load(base + cols, mask=cm, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) - tl.where(cols == safe, 1.0, 0.0)
        p = tl.where(valid, p, 0.0)
        tl.store(base + cols, p.to(x_ptr.dtype.element_ty), mask=cm)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_ce_kernel)


def ce_grad_triton_(logits: Tensor, target: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """:func:`ce_grad_torch_` as one Triton kernel that overwrites `logits` (row-major, unit column stride) with
    the gradient and returns (total, logits)."""
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the cross-entropy kernel cannot run: {why}")
    if logits.ndim != 2 or logits.stride(1) != 1 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be a row-major [n, V] tensor and target [n], got {tuple(logits.shape)} "
                         f"(strides {logits.stride()}) and {tuple(target.shape)}")
    n, V = logits.shape
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    if n:
        block = min(_BLOCK_V, 1 << max(V - 1, 1).bit_length())
        with torch.cuda.device(logits.device.index if logits.is_cuda else -1):  # -1: no-op (CPU, interpreter)
            _kernel(_triton.interpret())[(n,)](logits, target.contiguous(), loss, logits.stride(0), ignore_index, V=V,
                                        BLOCK=block, num_warps=8)
    return loss.sum(), logits


register(Op(
    "linear_ce", reference=ce_grad_torch_,
    fast=(Fast("triton", ce_grad_triton_, _triton.available, validated=True, cpu=True),),
    tolerance="loss 1e-6; gradient fp32 1e-6 of the largest entry (only the order of the sums differs), bf16 one "
              "step 2^-7 (both sides round the same fp32 values); the whole head under bf16 autocast 5e-3"))


def ce_grad_(logits: Tensor, target: Tensor, ignore_index: int = -100,
             backends: Backends | None = None) -> tuple[Tensor, Tensor]:
    """(summed cross-entropy, its gradient with respect to `logits`) on the implementation the registry picks (op
    ``linear_ce``); the Triton kernel reuses `logits`' memory for the gradient, the reference does not."""
    return dispatch("linear_ce", logits, backends).fn(logits, target, ignore_index)


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, target: Tensor, chunk: int, dtype: torch.dtype,
                ignore_index: int, backends: Backends | None) -> Tensor:
        hc, wc = h.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hc)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for i in range(0, h.shape[0], chunk):
            x, t = hc[i:i + chunk], target[i:i + chunk]
            # d(sum CE)/d(logits) = softmax - onehot on the valid rows, from the logits in the GEMM's dtype
            loss, g = ce_grad_(x @ wc.t(), t, ignore_index, backends)
            total += loss
            torch.mm(g, wc, out=grad_h[i:i + chunk])
            grad_w += (g.t() @ x).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, gout: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return ((grad_h * gout).to(ctx.h_dtype), (grad_w * gout).to(ctx.w_dtype), None, None, None, None, None)


def linear_cross_entropy(h: Tensor, weight: Tensor, target: Tensor, chunk_tokens: int = 8192,
                         ignore_index: int = -100, backends: Backends | None = None) -> Tensor:
    """Summed cross-entropy of ``h @ weight.T`` (h [N, D], weight [V, D]) against ``target`` [N] (ignore_index
    rows count nothing), as an fp32 scalar. See the module docstring; `backends` picks the gradient step's
    implementation (op ``linear_ce``)."""
    if h.ndim != 2 or weight.ndim != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h must be [N, D] and weight [V, D], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if target.shape != (h.shape[0],):
        raise ValueError(f"target must have shape [{h.shape[0]}], got {tuple(target.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    dtype = _compute_dtype(h, weight)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        with torch.autocast(h.device.type, enabled=False):
            return _LinearCE.apply(h, weight, target, chunk_tokens, dtype, ignore_index, backends)
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    wc = weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for i in range(0, h.shape[0], chunk_tokens):
            total += F.cross_entropy(_chunk_logits(h[i:i + chunk_tokens].to(dtype), wc), target[i:i + chunk_tokens],
                                     ignore_index=ignore_index, reduction="sum")
    return total
