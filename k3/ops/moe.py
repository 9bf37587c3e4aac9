"""Sigmoid router and latent MoE dispatch/combine (report §2.3, §2.3.3).

Routing (§2.3): every expert gets an independent sigmoid score. A per-expert bias,
adjusted outside the gradient by load balancing, steers which experts are *selected*
(top-k of ``scores + bias``), but the combine weights use the *unbiased* scores, so
balancing never distorts the mixture itself. The (k+1)-th largest biased score is
returned as well: it is the per-token cutoff ``alpha_i`` that Quantile Balancing uses
to set the biases.

Latent MoE (§2.3.3): routed experts run in a down-projected latent space of width L:
the model projects the hidden state to ``z`` [N, L] once, the experts map L -> F -> L,
and the model projects the combined ``u`` back up. This module is the part in between.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from k3.ops.moe_combine import moe_combine, moe_dispatch
from k3.ops.registry import Backends, Fast, Op, Target, dispatch, register, runs_on
from k3.ops.weight_cast import WeightCasts, cached_stack, weight
from k3.tensors import constant

__all__ = ["Routing", "route", "expert_load", "moe_experts", "moe_experts_any", "moe_experts_grouped",
           "grouped_available", "grouped_used"]


class Routing(NamedTuple):
    """Routing decision for N tokens over E experts, k per token."""

    weights: Tensor  # [N, k] fp32 combine weights: unbiased scores of the selected experts (renormalized, scaled)
    indices: Tensor  # [N, k] int64 selected experts: top-k of scores + bias
    scores: Tensor  # [N, E] fp32 unbiased sigmoid scores
    cutoff: Tensor  # [N] fp32 (k+1)-th largest biased score (Quantile Balancing's alpha_i); -inf when k == E


def route(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> Routing:
    """Sigmoid top-k routing with a selection-only bias.

    Args:
        logits: [N, E] router logits (the caller computes them in fp32).
        bias: [E] load-balancing bias, or None.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the selected scores by their sum (``+ 1e-20``).
        scaling_factor: multiplies the final weights (routed scaling factor).

    Returns:
        Routing(weights [N, k], indices [N, k], scores [N, E], cutoff [N]).
    """
    if logits.ndim != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits must be a floating [N, E] tensor, got shape {tuple(logits.shape)} dtype {logits.dtype}"
        )
    N, E = logits.shape
    if bias is not None and (bias.shape != (E,) or not bias.dtype.is_floating_point):
        raise ValueError(
            f"bias must be a floating [E={E}] tensor or None, got shape {tuple(bias.shape)} dtype {bias.dtype}"
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")

    scores = torch.sigmoid(logits.float())
    biased = scores if bias is None else scores + bias.float()

    if top_k < E:
        # One topk with k+1: the first k are the routes, the (k+1)-th is the cutoff.
        top_vals, top_idx = torch.topk(biased, top_k + 1, dim=-1)
        indices = top_idx[:, :top_k]
        cutoff = top_vals[:, top_k]
    else:
        indices = torch.topk(biased, top_k, dim=-1).indices
        cutoff = torch.full((N,), float("-inf"), device=logits.device)

    # The bias only selects; the mixture uses the unbiased scores (§2.3).
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling_factor
    return Routing(weights=weights, indices=indices, scores=scores, cutoff=cutoff)


def expert_load(indices: Tensor, num_experts: int) -> Tensor:
    """Tokens routed to each expert: [E] int64 counts, summing to ``indices.numel()``."""
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"indices must be an integer tensor, got dtype {indices.dtype}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    flat = indices.reshape(-1).long()
    if flat.numel() and bool(((flat < 0) | (flat >= num_experts)).any()):
        raise ValueError(
            f"indices must lie in [0, num_experts={num_experts}), got min {int(flat.min())} max {int(flat.max())}"
        )
    return torch.bincount(flat, minlength=num_experts)


def _check_expert_inputs(z, weights, indices, w1, w3, w2) -> None:
    if z.ndim != 2 or not z.dtype.is_floating_point:
        raise ValueError(f"z must be a floating [N, L] tensor, got shape {tuple(z.shape)} dtype {z.dtype}")
    N, L = z.shape
    if w1.ndim != 3 or w1.shape[2] != L:
        raise ValueError(f"w1 must have shape [E, F, L={L}], got {tuple(w1.shape)}")
    E, Fdim, _ = w1.shape
    if w3.shape != (E, Fdim, L):
        raise ValueError(f"w3 must have shape [E={E}, F={Fdim}, L={L}] like w1, got {tuple(w3.shape)}")
    if w2.shape != (E, L, Fdim):
        raise ValueError(f"w2 must have shape [E={E}, L={L}, F={Fdim}], got {tuple(w2.shape)}")
    if indices.ndim != 2 or indices.shape[0] != N:
        raise ValueError(f"indices must have shape [N={N}, k], got {tuple(indices.shape)}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"indices must be an integer tensor, got dtype {indices.dtype}")
    if weights.shape != indices.shape or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights must be a floating tensor of shape {tuple(indices.shape)} like indices, "
            f"got shape {tuple(weights.shape)} dtype {weights.dtype}"
        )


def moe_experts(
    z: Tensor,
    weights: Tensor,
    indices: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    act: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """Dispatch tokens to their experts and combine: ``u_n = sum_j p_nj * E_{e_nj}(z_n)``.

    ``E_e(z) = w2[e] @ act(w1[e] @ z, w3[e] @ z)``. Tokens are grouped by expert and each
    expert that received tokens runs once on its group (a reference; no capacity limit,
    no token dropping).

    Args:
        z: [N, L] latent inputs.
        weights: [N, k] combine weights (``Routing.weights``).
        indices: [N, k] selected experts (``Routing.indices``).
        w1: [E, F, L] gate projections.
        w3: [E, F, L] up projections.
        w2: [E, L, F] down projections.
        act: ``act(gate, up) -> hidden``, e.g. ``situ_glu``.

    Returns:
        u: [N, L] in ``z.dtype``. Expert matmuls run in ``z.dtype``; the weighted
        combine accumulates in fp32.
    """
    _check_expert_inputs(z, weights, indices, w1, w3, w2)
    N, L = z.shape
    E = w1.shape[0]

    # Group the N*k (token, expert) pairs by expert; a stable sort keeps token order.
    flat_expert = indices.reshape(-1).long()
    counts = expert_load(flat_expert, E)  # also checks the range of indices
    order = torch.argsort(flat_expert, stable=True)
    token_of = torch.arange(N, device=z.device).repeat_interleave(indices.shape[1])[order]
    weight_of = weights.reshape(-1)[order].float()

    u = torch.zeros(N, L, dtype=torch.float32, device=z.device)
    begin = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:  # experts that received no tokens do no work
            continue
        tokens = token_of[begin : begin + count]
        x = z[tokens]  # [count, L]
        hidden = act(x @ w1[e].to(z.dtype).T, x @ w3[e].to(z.dtype).T)  # [count, F]
        y = hidden.to(z.dtype) @ w2[e].to(z.dtype).T  # [count, L]
        u.index_add_(0, tokens, y.float() * weight_of[begin : begin + count, None])
        begin += count
    return u.to(z.dtype)


def grouped_available(target: Target) -> tuple[bool, str]:
    """Whether the `grouped` MoE backend can run on `target`'s device with expert inputs of its dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (needs torch >= 2.8)"
    if target.device.type == "cuda" and target.dtype != torch.bfloat16:
        return False, (f"the grouped GEMM on CUDA takes bf16 inputs, the experts get {target.dtype} (train under bf16 "
                       "autocast)")
    return True, ""


def moe_experts_grouped(
    z: Tensor,
    weights: Tensor,
    indices: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    act: Callable[[Tensor, Tensor], Tensor],
    w13: Tensor | None = None,
    act13: Callable[[Tensor], Tensor] | None = None,
    backends: Backends | None = None,
) -> Tensor:
    """``moe_experts`` with grouped GEMMs: the same result, three GEMM launches for all experts.

    The N*k (token, expert) pairs are sorted by expert (stable, so each expert sees its tokens in order);
    ``torch._grouped_mm`` computes every expert's gate and up projections against ``w1`` and ``w3`` (read
    transposed in place: no copy of the expert weights beyond a dtype cast), ``act(gate, up)`` (SiTU-GLU, fused
    on GPU) gives the hidden, and a third grouped GEMM applies ``w2``. The outputs are combined with the routing
    weights in fp32 by k3.ops.moe_combine (one Triton kernel on GPU, reading them in expert order). Every gather
    is a permutation, so the backward is free of atomic accumulation. Experts that got no tokens cost nothing.

    With ``w13`` ([E, 2F, L]: ``w1`` and ``w3`` stacked per expert, as ``k3.ops.weight_cast.cached_stack`` makes
    once per training step) and ``act13`` (``act`` of the [gate | up] columns of one tensor), the gate and up
    projections are one grouped GEMM and one fused activation: in backward, d(x) is one GEMM (no sum of two) and
    the activation's gradient one [M, 2F] tensor. ``w1`` and ``w3`` then only give the shapes.

    ``act13`` without ``w13`` and without gradients (serving): ``w13`` is w1 and w3 themselves where they are the
    halves of one tensor (:func:`interleaved_halves`, serving's experts stacked in place), else the two GEMMs. (That
    layout check reads storage addresses, which torch.compile cannot trace: it belongs inside this function, which
    a compiled decode step calls as it is.)

    Args: as ``moe_experts``, plus ``w13`` (with ``act13``), ``act13``, and ``backends`` for the dispatch and
    combine (op ``moe_combine``).
    Returns: u [N, L] in ``z.dtype``.
    """
    _check_expert_inputs(z, weights, indices, w1, w3, w2)
    if w13 is not None and act13 is None:
        raise ValueError("w13 and act13 go together: pass act13 with w13")
    if w13 is None and act13 is not None and not torch.is_grad_enabled():
        w13 = interleaved_halves(w1, w3)
    if w13 is not None and w13.shape != (w1.shape[0], 2 * w1.shape[1], w1.shape[2]):
        raise ValueError(f"w13 must have shape [E, 2F, L] = {(w1.shape[0], 2 * w1.shape[1], w1.shape[2])} "
                         f"(w1 and w3 stacked per expert), got {tuple(w13.shape)}")
    N, L = z.shape
    k = indices.shape[1]
    E = w1.shape[0]
    dt = z.dtype
    flat_expert = indices.reshape(-1)
    # The range check reads the indices back to the host; on CUDA (indices straight from the router's topk,
    # valid by construction) it is skipped so the layer runs without a device sync.
    if not z.is_cuda and flat_expert.numel() and bool(((flat_expert < 0) | (flat_expert >= E)).any()):
        raise ValueError(f"indices must lie in [0, num_experts={E}), got min {int(flat_expert.min())} "
                         f"max {int(flat_expert.max())}")
    sorted_expert, order = torch.sort(flat_expert, stable=True)  # [N*k] pair ids sorted by expert
    # offs[e]: the pairs routed to experts <= e, the end of expert e's rows (the cumulative counts), read off the
    # sorted ids: one search, no host sync
    offs = torch.searchsorted(sorted_expert, constant("arange", E, z.device, flat_expert.dtype), right=True,
                              out_int32=True)
    inverse = torch.empty_like(order)  # row of the sorted pairs holding each (token, slot)
    inverse[order] = constant("arange", order.numel(), order.device, order.dtype)
    x = moe_dispatch(z, order, inverse, k, backends)  # [M, L] grouped by expert

    if w13 is not None:
        h13 = torch._grouped_mm(x, w13.to(dt).transpose(1, 2), offs=offs)  # [M, 2F] = [gate | up]
        hidden = act13(h13).to(dt)  # [M, F]
    else:
        gate = torch._grouped_mm(x, w1.to(dt).transpose(1, 2), offs=offs)  # [M, F]
        up = torch._grouped_mm(x, w3.to(dt).transpose(1, 2), offs=offs)
        hidden = act(gate, up).to(dt)  # [M, F]
    y = torch._grouped_mm(hidden, w2.to(dt).transpose(1, 2), offs=offs)  # [M, L]

    return moe_combine(y, inverse, weights, dt, backends)  # sum_j weights[n, j] * y[inverse[n*k + j]] in fp32


register(Op(
    "moe", reference=moe_experts,
    fast=(Fast("grouped", moe_experts_grouped, grouped_available, validated=True, cpu=True),),
    tolerance="fp32: 1e-5 (the same products summed in another order); bf16 GEMMs against the fp32 loop: output "
              "2e-2, gradients 3e-2 relative (bf16 rounding of the inputs, h13 and the hidden)"))


def interleaved_halves(w1: Tensor, w3: Tensor) -> Tensor | None:
    """The [E, 2F, L] tensor whose per-expert halves w1 and w3 ([E, F, L]) are, where their memory is laid out so
    (k3.model.latent_moe.GroupedExperts.stack_halves: serving's experts, one grouped GEMM for gate and up); else
    None. Read from the layout itself: w1 = T[:, :F], w3 = T[:, F:] of one contiguous T."""
    if w1.dim() != 3 or w3.shape != w1.shape or w3.dtype != w1.dtype or w3.device != w1.device:
        return None
    E, F, L = w1.shape
    want = (2 * F * L, L, 1)
    if w1.stride() != want or w3.stride() != want:
        return None
    if w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr():
        return None
    if w3.data_ptr() - w1.data_ptr() != F * L * w1.element_size():
        return None
    return w1.as_strided((E, 2 * F, L), want)


def moe_experts_any(z: Tensor, weights: Tensor, indices: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                    act: Callable[[Tensor, Tensor], Tensor], act_fast: Callable[[Tensor, Tensor], Tensor],
                    act13: Callable[[Tensor], Tensor], backends: Backends | None = None,
                    casts: WeightCasts | None = None) -> Tensor:
    """The routed experts on the implementation the registry picks for z (op ``moe``), with the parameters
    w1, w3, w2 read through k3.ops.weight_cast with `casts` (the step's `WeightCasts`: cast once per training
    step; None: the plain autocast path):

    * the reference loop ``moe_experts`` with `act` (the activation's reference);
    * ``moe_experts_grouped`` with `act_fast` (the activation on its own fast path); when `casts` holds this
      step's w1 and w3 stacked per expert (training under autocast), gate and up are one grouped GEMM followed by
      `act13` on the [gate | up] columns (w1 and w3 then only give the shapes: no separate casts of them)."""
    impl = dispatch("moe", z, backends)  # its fn: opaque to a compiled decode step (k3.ops.registry.opaque)
    if impl.name == "grouped":
        w13 = cached_stack([w1, w3], dim=1, casts=casts)
        if w13 is None and torch.is_grad_enabled():
            act13 = None  # two GEMMs (without gradients: one where w1 and w3 are stacked in place, as in serving)
        return impl.fn(z, weights, indices, w1, w3, weight(w2, casts), act_fast, w13=w13, act13=act13,
                       backends=backends)
    return moe_experts(z, weights, indices, weight(w1, casts), weight(w3, casts), weight(w2, casts), act)


def grouped_used(device: torch.device, dtype: torch.dtype, backends: Backends | None = None) -> bool:
    """Whether the routed experts run on the grouped GEMMs (op ``moe``) for expert inputs of `dtype` on `device`:
    the serving engine asks ahead, since only that form can be captured in a CUDA graph (the reference loop reads
    the expert counts back to the host)."""
    return runs_on("moe", "grouped", Target(device, dtype), backends)
