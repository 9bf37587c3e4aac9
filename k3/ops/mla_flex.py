"""Gated MLA's training attention on flex_attention: the fast implementation ``flex`` of op ``mla``.

``mla_attention`` (k3.ops.mla) with q_start = 0 and Tq = Tk, as one fused kernel each way: causal and document
masks come as a block mask, so fully masked tiles are skipped and no T x T matrix is ever held, and QK-Clip's max
logit comes from the kernel's running maxima. The compiled kernels take block sizes from a table per GPU (torch's
own tables have none for the 192/128 head dims), or from ``Backends.flex_kernel_options`` / inductor's
max-autotune.

This file knows flex_attention only; k3.ops.mla holds the math it must reproduce and registers it with the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops.registry import Backends, Target, notice
from k3.tensors import LastResult

__all__ = ["causal_block_mask", "compiled_flex", "flex_available", "flex_kernel_options", "mla_attention_flex"]

_FLEX_BLOCK = 128  # the block mask's tile, tokens per side
_compiled_flex: dict[bool, object] = {}  # autotune? -> torch.compile'd flex_attention


# flex_attention's kernel options for Gated MLA's head dims (queries/keys 192, values 128) in bf16, by GPU compute
# capability: torch's own tables have no entry for this shape on sm90 and fall back to small tiles with 4 warps for
# the backward. benchmarks/flex_tune.py measures the candidates (BENCHMARKS.md keeps the figures). The keys are
# among registry.FLEX_OPTION_KEYS, the ones Backends.flex_kernel_options may set.
_FLEX_TUNED: dict[tuple[int, int], dict] = {
    (9, 0): dict(fwd_BLOCK_M=128, fwd_BLOCK_N=64, fwd_num_stages=3, fwd_num_warps=8,
                 bwd_BLOCK_M1=32, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=32, bwd_num_stages=2,
                 bwd_num_warps=8),
}


def flex_kernel_options(q: Tensor, v: Tensor, backends: Backends | None = None) -> dict | None:
    """kernel_options for flex_attention on q's device: ``Backends.flex_kernel_options`` (``fwd_*`` / ``bwd_*`` block
    sizes, stages and warps; ``{}`` for torch's defaults) when set, else the table for this GPU at Gated MLA's bf16
    192/128 shape, else None (torch's defaults)."""
    opts = None if backends is None else backends.flex_kernel_options
    if opts is not None:
        return dict(opts) or None
    if not q.is_cuda or q.dtype != torch.bfloat16 or q.shape[-1] != 192 or v.shape[-1] != 128:
        return None
    return _FLEX_TUNED.get(torch.cuda.get_device_capability(q.device))


def compiled_flex(autotune: bool = False):
    """flex_attention under torch.compile (static shapes), one compiled function per autotune setting. `autotune`:
    inductor's max-autotune, which benchmarks the forward and backward kernels' block sizes and stages for each
    shape (minutes more compilation on first use) instead of taking fixed ones."""
    from torch.nn.attention import flex_attention as fa

    if autotune not in _compiled_flex:
        notice("compiling the flex_attention MLA kernels (once per shape; the first call takes a while"
               + (", longer with flex_autotune)" if autotune else ")"))
        mode = "max-autotune-no-cudagraphs" if autotune else None
        _compiled_flex[autotune] = torch.compile(fa.flex_attention, dynamic=False, mode=mode)
    return _compiled_flex[autotune]


def flex_available(target: Target) -> tuple[bool, str]:
    """Whether this torch has flex_attention with the kernel's running maxima (QK-Clip's max logit comes from
    them: ``AuxRequest(max_scores=True)``)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention  # noqa: F401
    except Exception as e:
        return False, f"torch {torch.__version__} has no usable flex_attention ({type(e).__name__}: {e})"
    if "max_scores" not in getattr(AuxRequest, "_fields", ()):
        return False, f"torch {torch.__version__}'s flex_attention cannot return its max scores (QK-Clip's max logit)"
    return True, ""


# Every Gated MLA layer of one forward (and the recomputation of activation checkpointing) asks for the same mask,
# so it is built once per batch, not per layer.
_last_mask = LastResult()


def causal_block_mask(T: int, device: torch.device, segment_ids: Tensor | None = None):
    """flex_attention BlockMask for causal attention, restricted to each packed document when `segment_ids`
    [B, T] is given. Built from per-block document ranges in O((T/128)^2) memory per row, never O(T^2):
    a (query block, key block) tile is skipped when their documents cannot meet, taken whole when both
    blocks lie in one document and the key block is strictly earlier, and masked per element otherwise.

    The mask of the previous call is returned again when T, the device and `segment_ids` (the same tensor
    object, not modified since) are the same."""
    return _last_mask.get((T, torch.device(device), segment_ids),
                          lambda: _build_causal_block_mask(T, device, segment_ids))


def _build_causal_block_mask(T: int, device: torch.device, segment_ids: Tensor | None = None):
    from torch.nn.attention.flex_attention import BlockMask

    n = -(-T // _FLEX_BLOCK)
    idx = torch.arange(n, device=device)
    lower = idx[None, :] <= idx[:, None]  # [n, n] key block j <= query block i
    strict = idx[None, :] < idx[:, None]
    if segment_ids is None:
        B = 1
        partial = torch.eye(n, dtype=torch.bool, device=device)[None]
        full = strict[None]

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    else:
        B = segment_ids.shape[0]
        seg = segment_ids.to(device=device, dtype=torch.int64)
        pad = n * _FLEX_BLOCK - T
        padded = torch.cat([seg, seg[:, -1:].expand(B, pad)], dim=1) if pad else seg
        blocks = padded.view(B, n, _FLEX_BLOCK)
        lo, hi = blocks.amin(-1), blocks.amax(-1)  # [B, n] document range of each block
        meet = (lo[:, None, :] <= hi[:, :, None]) & (hi[:, None, :] >= lo[:, :, None])  # [B, i, j]
        single = lo == hi
        same = single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
        full = strict[None] & same
        partial = lower[None] & meet & ~full

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (seg[b, q_idx] == seg[b, kv_idx])

    def as_blocks(m: Tensor) -> tuple[Tensor, Tensor]:
        counts = m.sum(-1, dtype=torch.int32)  # [B, n]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # listed blocks first
        return counts[:, None], order[:, None]

    kv_num, kv_idx = as_blocks(partial)
    full_num, full_idx = as_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def mla_attention_flex(q: Tensor, k: Tensor, v: Tensor, scale: float, segment_ids: Tensor | None = None,
                       block_mask=None, return_max_logit: bool = False, compiled: bool = True,
                       autotune: bool | None = None, backends: Backends | None = None):
    """``mla_attention`` (q_start = 0, Tq = Tk) on flex_attention: fused causal/document-masked attention with
    the 192/128 head dims, no T x T matrix in memory, fully masked tiles skipped.

    Returns o [B, T, H, Dv], or (o, max_logit [H] fp32) with ``return_max_logit``: the largest scaled pre-softmax
    logit of each head over the visible pairs (QK-Clip's signal), from the kernel's running maxima, which
    flex_attention keeps on CUDA only (on other devices ``k3.ops.mla.max_logit`` computes it). ``autotune``
    (default: ``backends.flex_autotune``) compiles with inductor's max-autotune (see :func:`compiled_flex`);
    otherwise the kernels take :func:`flex_kernel_options`. ``compiled=False`` runs flex_attention eagerly (unfused,
    for tests of the block mask)."""
    from torch.nn.attention import flex_attention as fa

    if return_max_logit and not q.is_cuda:
        raise ValueError(f"flex_attention returns its max scores on CUDA only, got device {q.device}: take the max "
                         "logit from k3.ops.mla.max_logit")
    B, T, H, _ = q.shape
    if block_mask is None:
        block_mask = causal_block_mask(T, q.device, segment_ids)
    if autotune is None:
        autotune = backends is not None and backends.flex_autotune
    fn = compiled_flex(autotune) if compiled else fa.flex_attention
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # max-autotune picks its own tiles; eager flex (compiled=False) is the unfused reference and takes no tiles
    opts = flex_kernel_options(q, v, backends) if compiled and not autotune else None
    if return_max_logit:
        o, aux = fn(qt, kt, vt, block_mask=block_mask, scale=scale, kernel_options=opts,
                    return_aux=fa.AuxRequest(max_scores=True))
        return o.transpose(1, 2), aux.max_scores.detach().float().amax(dim=(0, 2))
    return fn(qt, kt, vt, block_mask=block_mask, scale=scale, kernel_options=opts).transpose(1, 2)


def mla_attention_flex_op(q: Tensor, k: Tensor, v: Tensor, scale: float, segment_ids: Tensor | None = None,
                          return_max_logit: bool = False, backends: Backends | None = None, make_block_mask=None):
    """:func:`mla_attention_flex` with op ``mla``'s signature (what the registry calls): the block mask of
    `segment_ids` from `make_block_mask(device)` when given (built once per batch), else :func:`causal_block_mask`."""
    mask = make_block_mask(q.device) if make_block_mask is not None and segment_ids is not None else None
    return mla_attention_flex(q, k, v, scale, segment_ids, block_mask=mask, return_max_logit=return_max_logit,
                              backends=backends)
