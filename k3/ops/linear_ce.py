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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["linear_cross_entropy"]


def _compute_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's, when it is on for h's device, else h's."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


def _chunk_logits(hc: Tensor, wc: Tensor) -> Tensor:
    return (hc @ wc.t()).float()


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, target: Tensor, chunk: int, dtype: torch.dtype,
                ignore_index: int) -> Tensor:
        hc, wc = h.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hc)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        for i in range(0, h.shape[0], chunk):
            x, t = hc[i:i + chunk], target[i:i + chunk]
            logits = _chunk_logits(x, wc)
            valid = t != ignore_index
            safe = torch.where(valid, t, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None])[:, 0]
            total += ((lse - picked) * valid).sum()
            # d(sum CE)/d(logits) = softmax - onehot on the valid rows, computed in place of the logits
            p = logits.sub_(lse[:, None]).exp_()
            p.scatter_add_(1, safe[:, None], -torch.ones_like(picked)[:, None])
            g = p.mul_(valid[:, None]).to(dtype)
            grad_h[i:i + chunk] = g @ wc
            grad_w += (g.t() @ x).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, gout: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return ((grad_h * gout).to(ctx.h_dtype), (grad_w * gout).to(ctx.w_dtype), None, None, None, None)


def linear_cross_entropy(h: Tensor, weight: Tensor, target: Tensor, chunk_tokens: int = 8192,
                         ignore_index: int = -100) -> Tensor:
    """Summed cross-entropy of ``h @ weight.T`` (h [N, D], weight [V, D]) against ``target`` [N] (ignore_index
    rows count nothing), as an fp32 scalar. See the module docstring."""
    if h.ndim != 2 or weight.ndim != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h must be [N, D] and weight [V, D], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if target.shape != (h.shape[0],):
        raise ValueError(f"target must have shape [{h.shape[0]}], got {tuple(target.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    dtype = _compute_dtype(h, weight)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        with torch.autocast(h.device.type, enabled=False):
            return _LinearCE.apply(h, weight, target, chunk_tokens, dtype, ignore_index)
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    wc = weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for i in range(0, h.shape[0], chunk_tokens):
            total += F.cross_entropy(_chunk_logits(h[i:i + chunk_tokens].to(dtype), wc), target[i:i + chunk_tokens],
                                     ignore_index=ignore_index, reduction="sum")
    return total
