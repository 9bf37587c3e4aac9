"""Block Attention Residuals (report §2.2).

Instead of the fixed residual sum ``h_l = h_{l-1} + f_{l-1}(h_{l-1})``, each residual
"site" of K3 (the input of an attention or MLP sublayer, and the final norm) mixes the
earlier representations ("sources") with softmax weights over depth:

    score_i  = RMSNorm(v_i) . w          (RMSNorm without affine; w is the site's query)
    weight_i = softmax_i(score_i)
    h        = sum_i weight_i * v_i      (the RAW sources, not the normalized ones)

RMSNorm makes the score depend on the direction of a source only, not its magnitude,
so a layer cannot win the softmax just by growing its output. The query ``w`` [D] is a
learned parameter, not a function of the input: the checkpoint stores a norm weight
γ [D] and a projection [1, D], and the caller passes ``w = γ * proj``.

"Block" AttnRes groups layers into blocks: the sources of a site are the completed
block representations plus the running partial sum of the current block. Because the
queries are input-independent, every site of a block attends to the same completed
blocks, which gives the two-phase inference form:

1. ``attn_res_inter``: one batched pass of all S site queries of the block over the
   completed blocks, kept as online-softmax statistics (max, denominator, accumulator);
2. ``attn_res_merge``: per site, fold in the current block's partial sum by online softmax.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from k3.ops.registry import Backends, Fast, Op, Target, dispatch, importable, register
from k3.tensors import constant

__all__ = ["AttnResPartial", "attn_res", "attn_res_any", "attn_res_fla", "attn_res_inter", "attn_res_merge",
           "fla_available"]


class AttnResPartial(NamedTuple):
    """Online-softmax statistics of S sites over the completed blocks (all fp32)."""

    m: Tensor  # [S, ...] running max of the scores
    l: Tensor  # [S, ...] sum_i exp(score_i - m)
    acc: Tensor  # [S, ..., D] sum_i exp(score_i - m) * v_i


def _stack_sources(name: str, sources: Tensor | Sequence[Tensor]) -> Tensor:
    """Tensor [N, ..., D] or list of N tensors [..., D] -> Tensor [N, ..., D] (N >= 1)."""
    if isinstance(sources, Tensor):
        if sources.ndim < 2:
            raise ValueError(f"{name} as a tensor must be [N, ..., D] with at least 2 dims, got {tuple(sources.shape)}")
        stacked = sources
    else:
        sources = list(sources)
        if not sources:
            raise ValueError(f"{name} must hold at least one source, got an empty list")
        first = sources[0]
        for i, s in enumerate(sources):
            if not isinstance(s, Tensor) or s.shape != first.shape or s.dtype != first.dtype:
                got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, Tensor) else type(s).__name__
                raise ValueError(
                    f"{name}[{i}] must be a tensor of shape {tuple(first.shape)} and dtype {first.dtype} "
                    f"like {name}[0], got {got}"
                )
        if first.ndim < 1:
            raise ValueError(f"{name} entries must be [..., D] with at least 1 dim, got scalars")
        stacked = torch.stack(sources)
    if stacked.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one source, got N=0 (shape {tuple(stacked.shape)})")
    if not stacked.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating, got dtype {stacked.dtype}")
    return stacked


def _check_query(name: str, w: Tensor, dim: int, leading: tuple[int, ...] = ()) -> None:
    want = (*leading, dim)
    if not isinstance(w, Tensor) or w.shape != want:
        got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"{name} must have shape {list(want)} (the site query over D={dim}), got {got}")


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without affine over the last dim, on fp32 values."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def attn_res(sources: Tensor | Sequence[Tensor], w: Tensor, eps: float = 1e-5) -> Tensor:
    """Direct form of one AttnRes site.

    Args:
        sources: Tensor [N, ..., D] or a list of N tensors [..., D] (same shape and dtype).
        w: [D] the site's effective query (``γ * proj``).
        eps: RMSNorm epsilon.

    Returns:
        [..., D] ``sum_i softmax_i(RMSNorm(v_i) . w) * v_i``, computed in fp32 and
        returned in the sources' dtype.
    """
    v = _stack_sources("sources", sources)
    _check_query("w", w, v.shape[-1])

    scores = (_rms_normalize(v, eps) * w.float()).sum(dim=-1)  # [N, ...]
    weights = torch.softmax(scores, dim=0)  # softmax over depth (the sources)
    out = (weights[..., None] * v.float()).sum(dim=0)
    return out.to(v.dtype)


def fla_available(target: Target) -> tuple[bool, str]:
    return importable("fla.ops.attnres")


def attn_res_fla(sources: Sequence[Tensor], w: Tensor, eps: float = 1e-5) -> Tensor:
    """``attn_res`` on fla-core's fused kernel: one read of every source computes the scores, the depth
    softmax and the mix (fp32 inside), and the backward recomputes instead of storing the normalized
    sources. Sources must be CUDA tensors of one shape and dtype. The kernel reads each from a 16-byte aligned
    address, so a source that does not start on one (a slice of a larger tensor) is copied first."""
    from fla.ops.attnres import fused_attnres

    sources = [s if s.data_ptr() % 16 == 0 else s.clone() for s in sources]
    v = sources[0]
    _check_query("w", w, v.shape[-1])
    # the norm weight fla's kernel takes, all ones (w holds gamma): a constant made once per device
    return fused_attnres(w.float(), sources, constant("ones", v.shape[-1], v.device, torch.float32), rms_eps=eps)


register(Op(
    "attn_res", reference=attn_res,
    fast=(Fast("fla", attn_res_fla, fla_available, validated=True),),
    tolerance="fp32: 1e-5 of the largest entry (the same sums in another order); bf16 sources: 1e-2 (one bf16 "
              "rounding of the output), gradients 3x that"))


def attn_res_any(sources: Sequence[Tensor], w: Tensor, eps: float = 1e-5, backends: Backends | None = None) -> Tensor:
    """``attn_res`` on the implementation the registry picks for the sources (op ``attn_res``: fla-core's fused
    kernel on GPU). `sources`: a list of tensors of one shape and dtype."""
    return dispatch("attn_res", sources[0], backends).fn(sources, w, eps)


def attn_res_inter(blocks: Tensor | Sequence[Tensor], ws: Tensor, eps: float = 1e-5) -> AttnResPartial:
    """Phase 1 of the two-phase form: all S sites of a block over the completed blocks.

    Args:
        blocks: Tensor [N, ..., D] or list of N tensors [..., D]: the completed block
            representations, shared by every site of the current block.
        ws: [S, D] the queries of the S sites of the current block.
        eps: RMSNorm epsilon.

    Returns:
        AttnResPartial(m [S, ...], l [S, ...], acc [S, ..., D]) in fp32.
    """
    v = _stack_sources("blocks", blocks)
    if ws.ndim != 2:
        raise ValueError(f"ws must have shape [S, D={v.shape[-1]}], got {tuple(ws.shape)}")
    _check_query("ws", ws, v.shape[-1], leading=(ws.shape[0],))

    v32 = v.float()
    # The blocks are normalized once and scored by all S queries in one matmul.
    scores = torch.einsum("n...d,sd->sn...", _rms_normalize(v32, eps), ws.float())  # [S, N, ...]
    m = scores.amax(dim=1)  # [S, ...]
    p = torch.exp(scores - m[:, None])  # [S, N, ...], unnormalized
    l = p.sum(dim=1)
    acc = torch.einsum("sn...,n...d->s...d", p, v32)
    return AttnResPartial(m=m, l=l, acc=acc)


def attn_res_merge(
    partial: AttnResPartial, site: int, current: Tensor, w: Tensor, eps: float = 1e-5
) -> Tensor:
    """Phase 2: fold the current block's partial sum into site ``site``'s statistics.

    Args:
        partial: the result of ``attn_res_inter(blocks, ws)``.
        site: which of the S sites (row of ``ws``) this is.
        current: [..., D] the current block's partial sum (the last source).
        w: [D] the site's query; must be ``ws[site]`` of phase 1.
        eps: RMSNorm epsilon.

    Returns:
        [..., D] equal to ``attn_res(list(blocks) + [current], w)``, in ``current.dtype``.
    """
    if not isinstance(partial, AttnResPartial):
        raise ValueError(f"partial must be an AttnResPartial from attn_res_inter, got {type(partial).__name__}")
    S = partial.m.shape[0]
    if not isinstance(site, int) or isinstance(site, bool) or not 0 <= site < S:
        raise ValueError(f"site must be an int in [0, {S}) (one of the S={S} sites of the partial), got {site!r}")
    if not isinstance(current, Tensor) or not current.dtype.is_floating_point:
        raise ValueError("current must be a floating tensor [..., D]")
    if current.shape != partial.acc.shape[1:]:
        raise ValueError(
            f"current must have shape {tuple(partial.acc.shape[1:])} like the blocks of the partial, "
            f"got {tuple(current.shape)}"
        )
    _check_query("w", w, current.shape[-1])

    m, l, acc = partial.m[site], partial.l[site], partial.acc[site]
    cur = current.float()
    score = (_rms_normalize(cur, eps) * w.float()).sum(dim=-1)  # [...]

    # Online softmax: rescale both sides to the new running max before adding.
    m_new = torch.maximum(m, score)
    old = torch.exp(m - m_new)
    new = torch.exp(score - m_new)
    out = (acc * old[..., None] + cur * new[..., None]) / (l * old + new)[..., None]
    return out.to(current.dtype)
