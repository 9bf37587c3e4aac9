"""Weights cast to the autocast dtype once per training step, their gradients summed straight into fp32 ``.grad``.

Under bf16 autocast each matmul casts its fp32 weight to bf16 in every forward, and in backward autograd casts
the bf16 weight gradient back to fp32 (``ToCopyBackward``) and then adds it to ``.grad``: three passes over every
weight per micro-batch (BENCHMARKS.md has what that costs k3-mini).
Weights taken through :func:`weight`, :func:`stacked_weight` or :func:`cached_stack` with a :class:`WeightCasts`:

* are cast once and reused by every later micro-batch of the step (a weight changed in place on the parameter
  since, which bumps its version counter, is cast again);
* send their gradient into the parameter's fp32 ``.grad`` in one pass: a copy for the first contribution, an
  fp32 add of the bf16 gradient after that. That is exactly what autograd computes (cast to fp32, then add), so
  gradients are bitwise the same as without the cache.

Nothing here is global: a `WeightCasts` is an object its owner (the trainer, for one optimizer step) creates and
hands to one model for that step's micro-batches (``K3ForCausalLM.use_weight_casts``); another model in the same
process never sees it. Because these gradients reach ``.grad`` outside autograd's leaf accumulation, hooks on the
parameters (``register_hook``, ``register_post_accumulate_grad_hook``) do not see them: k3's trainer reads
``.grad`` after backward (its data-parallel reduction included); wrappers built on such hooks (torch DDP, FSDP)
must not be given one. Without a `WeightCasts`, without autocast, or for a weight that is not an fp32 leaf, these
functions leave the computation as it was (the parameter itself, the per-call fp32 cat, or None from
cached_stack).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["WeightCasts", "weight", "stacked_weight", "cached_stack"]


class WeightCasts:
    """The cast copies of one optimizer step: ``weight(p, casts)`` and friends cast each weight once and route its
    gradient into ``.grad`` (see the module docstring); :meth:`clear` (or dropping the object) frees them.

    Owned by whoever runs the step (the trainer makes one per step when it trains under bf16 autocast) and handed
    to one model for that step's micro-batches with ``K3ForCausalLM.use_weight_casts(casts)``; the backward of
    those micro-batches (and the recompute of activation checkpointing, which runs in it) must run inside that
    scope too. Under FSDP2 it stays off: FSDP2 unshards the parameters for each forward and its
    ``MixedPrecisionPolicy`` casts them to the compute dtype itself, and it reduces gradients through the very
    autograd hooks this mechanism bypasses; a trainer sharded with FSDP2 hands the model no `WeightCasts`."""

    def __init__(self) -> None:
        # key (parameter ids, dtype, pad, dim) -> (parameters, their versions when cast, the cast tensor)
        self._cache: dict[tuple, tuple[tuple[Tensor, ...], tuple[int, ...], Tensor]] = {}
        self.casts = 0  # copies made so far (tests and benchmarks read it)

    def clear(self) -> None:
        """Drop the cast copies (the next use casts again)."""
        self._cache.clear()

    def _cached(self, params: tuple[Tensor, ...], dt: torch.dtype, pad: int, dim: int = 0) -> Tensor:
        key = (tuple(id(p) for p in params), dt, pad, dim)
        versions = tuple(p._version for p in params)
        hit = self._cache.get(key)
        if hit is not None and hit[1] == versions:
            return hit[2]
        with torch.no_grad():
            if len(params) == 1 and not pad:
                w = params[0].detach().to(dt)
            else:
                shape = list(params[0].shape)
                shape[dim] = sum(p.shape[dim] for p in params) + pad
                w = torch.empty(shape, device=params[0].device, dtype=dt)
                off = 0
                for p in params:
                    w.narrow(dim, off, p.shape[dim]).copy_(p.detach())
                    off += p.shape[dim]
                if pad:
                    w.narrow(dim, off, pad).zero_()
        self.casts += 1
        self._cache[key] = (params, versions, w)
        return w


def _cast_dtype(p: Tensor, casts: WeightCasts | None) -> torch.dtype | None:
    """The dtype autocast would cast `p` to here, when `casts` applies to it, else None. Only leaf tensors
    (parameters) are cached: a computed weight (a fake-quantized copy, a slice) is a new tensor each forward."""
    if casts is None or p.dtype != torch.float32 or not p.is_leaf:
        return None
    dev = p.device.type
    if not torch.amp.is_autocast_available(dev) or not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return dt if dt in (torch.bfloat16, torch.float16) else None


def _accumulate(p: Tensor, g: Tensor) -> None:
    """p.grad += g in fp32 (a copy for the first contribution), as autograd's cast + accumulation would."""
    if p.grad is None:
        p.grad = torch.empty_like(p).copy_(g)
    else:
        p.grad.add_(g)


class _CastWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, dim: int, *params: Tensor) -> Tensor:
        ctx.params, ctx.dim = params, dim
        return w

    @staticmethod
    def backward(ctx, g: Tensor):
        off = 0
        for p in ctx.params:
            if p.requires_grad:
                _accumulate(p, g.narrow(ctx.dim, off, p.shape[ctx.dim]))
            off += p.shape[ctx.dim]
        return (None,) * (2 + len(ctx.params))


def cached_stack(params: Sequence[Tensor], dim: int = 0, pad: int = 0,
                 casts: WeightCasts | None = None) -> Tensor | None:
    """``torch.cat(params (+ `pad` zero slices), dim)`` in the autocast dtype, made once per step, with each
    parameter's slice of the gradient going to its ``.grad``, when the cache applies (a `casts`, autocast, fp32
    leaf parameters); None otherwise, so that callers keep their own path (for the experts' w1/w3, the parameters
    one by one: a stacked copy made on every call would cost a pass over the weights each time)."""
    params = tuple(params)
    dt = _cast_dtype(params[0], casts)
    if dt is None or any(_cast_dtype(p, casts) != dt for p in params[1:]):
        return None
    w = casts._cached(params, dt, pad, dim)
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return _CastWithGrad.apply(w, dim, *params)
    return w


def weight(p: Tensor, casts: WeightCasts | None = None) -> Tensor:
    """`p` as the matmul will use it: with `casts` under autocast, its cached cast copy (gradient into
    ``p.grad``); otherwise `p` itself."""
    w = cached_stack((p,), casts=casts)
    return p if w is None else w


def stacked_weight(params: Sequence[Tensor], pad: int = 0, casts: WeightCasts | None = None) -> Tensor:
    """``torch.cat(params + [pad zero rows])``: with `casts` under autocast, cached in the autocast dtype with each
    parameter's rows of the gradient going to its ``.grad``; otherwise the fp32 cat itself (made per call,
    gradients through autograd)."""
    w = cached_stack(params, 0, pad, casts)
    if w is not None:
        return w
    ws = list(params)
    if pad:
        ws.append(ws[0].new_zeros((pad,) + tuple(ws[0].shape[1:])))
    return torch.cat(ws)
