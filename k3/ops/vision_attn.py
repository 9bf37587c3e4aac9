"""MoonViT-V2's attention over packed images of different sizes: op ``vision_attn`` (report §2.4).

The encoder works at native resolution, so the images of one batch have different patch counts. Instead of padding
them to one size or running one forward per size, their patch tokens are concatenated into one packed sequence of
T = sum(L_i) tokens, and attention is restricted to each image: full (bidirectional) softmax attention among the
L_i patches of image i, nothing across images. The attention matrix is block diagonal:

    o[t] = sum_{s in image(t)} softmax_s(q[t] . k[s] / sqrt(d)) v[s]

Every other part of a ViT block (norms, projections, MLP) is per token, so a block runs on the packed sequence as
it is and only this op needs to know where the images start (`ImagePacking`, built once per forward from the
images' sizes on the host).

Implementations (k3.ops.registry):

* reference (``torch``): each image's slice through scaled_dot_product_attention, one call per image, unmasked.
  Exact, runs anywhere, memory O(max L_i^2) per head rather than O(T^2) for a dense block-diagonal mask.
* ``varlen``: FlashAttention's variable-length kernel (torch.nn.attention.varlen.varlen_attn) with the images'
  cumulative offsets; CUDA, bf16/fp16. One launch for the whole packed sequence, no compilation.
* ``flex``: flex_attention with a block mask of the images (tiles across two images are skipped, tiles inside one
  image are taken whole), compiled with dynamic shapes since the packed length changes every batch; CUDA, any float
  dtype (fp32 included).

Validation on a GPU (an H100, 2026-12-06): ``varlen`` passed its op tests (output and gradients) and the packed
encoder's (tests/ops/test_vision_attn.py, tests/model/test_vision_reference.py, marked `gpu`), so ``auto`` takes it
for bf16/fp16. ``flex`` passed its op tests in bf16 and fp32 (1e-5) and the encoder's in bf16 and fp32 (fp32 within
1e-4 of the float64 reference encoder once the patch embedding's cuDNN convolution runs in fp32 rather than TF32,
torch's default for cuDNN), so ``auto`` takes it for fp32.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops.registry import Backends, Fast, Op, Target, dispatch, notice, register

__all__ = ["ImagePacking", "vision_attention", "vision_attention_reference", "vision_attention_varlen",
           "vision_attention_flex", "varlen_available", "flex_available"]

_FLEX_BLOCK = 128  # flex_attention's tile, tokens per side


class ImagePacking:
    """Where each image's patch tokens lie in a packed sequence: image i holds tokens
    [offsets[i], offsets[i] + lengths[i]). Built on the host from the images' patch counts; the device tensors the
    fast paths need (cumulative offsets, the flex block mask) are built once per device and reused by every layer."""

    def __init__(self, lengths: Sequence[int]):
        lengths = tuple(lengths)
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"ImagePacking: image {i} has {n!r} tokens; every image needs a positive int count")
        self.lengths = lengths
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.offsets = tuple(offsets)  # [n_images + 1], offsets[-1] = total tokens
        self._device: dict[tuple[str, torch.device], object] = {}

    @property
    def total(self) -> int:
        return self.offsets[-1]

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    def __len__(self) -> int:
        return len(self.lengths)

    def __repr__(self) -> str:
        return f"ImagePacking(lengths={list(self.lengths)})"

    def _cached(self, what: str, device: torch.device, build):
        key = (what, torch.device(device))
        if key not in self._device:
            self._device[key] = build()
        return self._device[key]

    def cu_seqlens(self, device: torch.device) -> Tensor:
        """The offsets as an int32 tensor [n_images + 1] on `device` (FlashAttention's cu_seqlens)."""
        return self._cached("cu", device, lambda: torch.tensor(self.offsets, dtype=torch.int32).to(device))

    def segment_ids(self, device: torch.device) -> Tensor:
        """[total] int64: the image each token belongs to."""
        return self._cached("seg", device, lambda: torch.repeat_interleave(
            torch.arange(len(self.lengths)), torch.tensor(self.lengths)).to(device))

    def block_mask(self, device: torch.device):
        """flex_attention's BlockMask of the block-diagonal pattern on `device` (see :func:`image_block_mask`)."""
        return self._cached("mask", device, lambda: image_block_mask(self, device))

    def check(self, q: Tensor) -> None:
        if q.dim() != 3 or q.shape[0] != self.total:
            raise ValueError(f"packed q must be [total tokens = {self.total}, heads, head_dim] for {self}, "
                             f"got shape {tuple(q.shape)}")


def image_block_mask(packing: ImagePacking, device: torch.device):
    """BlockMask for bidirectional attention within each image of `packing`, from per-tile image ranges (O((T/128)^2)
    booleans, never T x T): a (query tile, key tile) pair is skipped when their image ranges do not overlap, taken
    whole when both tiles lie inside one and the same image, and masked per element otherwise."""
    from torch.nn.attention.flex_attention import BlockMask

    T = packing.total
    seg = packing.segment_ids(device)
    n = -(-T // _FLEX_BLOCK)
    pad = n * _FLEX_BLOCK - T
    padded = torch.cat([seg, seg[-1:].expand(pad)]) if pad else seg
    blocks = padded.view(n, _FLEX_BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [n] image range of each tile
    meet = (lo[None, :] <= hi[:, None]) & (hi[None, :] >= lo[:, None])  # [query tile, key tile]
    single = lo == hi
    full = single[:, None] & single[None, :] & (lo[:, None] == lo[None, :])
    partial = meet & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        return seg[q_idx] == seg[kv_idx]

    def as_blocks(m: Tensor) -> tuple[Tensor, Tensor]:
        counts = m.sum(-1, dtype=torch.int32)  # [n]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # listed tiles first
        return counts[None, None], order[None, None]

    kv_num, kv_idx = as_blocks(partial)
    full_num, full_idx = as_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


# --- the implementations -------------------------------------------------------------------------------------------

def vision_attention_reference(q: Tensor, k: Tensor, v: Tensor, packing: ImagePacking,
                               backends: Backends | None = None) -> Tensor:
    """The definition: q, k, v [T, H, D] packed -> o [T, H, D], each image's tokens attending to all of its own
    tokens only (scale 1/sqrt(D)). One scaled_dot_product_attention per image, on its slice."""
    packing.check(q)
    out = []
    for s, e in zip(packing.offsets[:-1], packing.offsets[1:]):
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        out.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1))
    return torch.cat(out, 0) if out else q.new_zeros(q.shape[:2] + v.shape[-1:])


def varlen_available(target: Target) -> tuple[bool, str]:
    """FlashAttention's varlen kernel: CUDA, bf16 or fp16, and a torch that has torch.nn.attention.varlen."""
    if target.dtype not in (torch.bfloat16, torch.float16):
        return False, f"FlashAttention's varlen kernel takes bf16/fp16, got {target.dtype}"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except Exception as e:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen ({type(e).__name__}: {e})"
    return True, ""


def vision_attention_varlen(q: Tensor, k: Tensor, v: Tensor, packing: ImagePacking,
                            backends: Backends | None = None) -> Tensor:
    """The op on FlashAttention's variable-length kernel: one launch over the packed sequence, image i's queries
    seeing keys offsets[i]..offsets[i+1] (cu_seqlens), full (non-causal) attention."""
    from torch.nn.attention.varlen import varlen_attn

    packing.check(q)
    cu = packing.cu_seqlens(q.device)
    L = packing.max_len
    return varlen_attn(q, k, v, cu, cu, L, L, scale=1.0 / math.sqrt(q.shape[-1]))


def flex_available(target: Target) -> tuple[bool, str]:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception as e:
        return False, f"torch {torch.__version__} has no usable flex_attention ({type(e).__name__}: {e})"
    return True, ""


_compiled: list = []  # the compiled flex_attention, built on first use


def _compiled_flex():
    if not _compiled:
        from torch.nn.attention.flex_attention import flex_attention

        notice("compiling flex_attention for the vision encoder (dynamic shapes: once, not once per packed length)")
        _compiled.append(torch.compile(flex_attention, dynamic=True))
    return _compiled[0]


def vision_attention_flex(q: Tensor, k: Tensor, v: Tensor, packing: ImagePacking, backends: Backends | None = None,
                          compiled: bool = True) -> Tensor:
    """The op on flex_attention with the images' block mask. ``compiled=False`` runs flex_attention eagerly (unfused,
    every listed tile computed with the element mask: for tests of the block mask on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    packing.check(q)
    fn = _compiled_flex() if compiled else flex_attention
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    o = fn(qt, kt, vt, block_mask=packing.block_mask(q.device), scale=1.0 / math.sqrt(q.shape[-1]))
    return o[0].transpose(0, 1)


register(Op(
    "vision_attn", reference=vision_attention_reference,
    fast=(Fast("varlen", vision_attention_varlen, varlen_available, validated=True),
          Fast("flex", vision_attention_flex, flex_available, validated=True)),
    tolerance="fp32 (eager flex on CPU, compiled flex on GPU): 1e-5 relative; bf16 (varlen, flex) against the fp32 "
              "reference: output and gradients 2e-2 relative (bf16 rounding of q.k and of the output)"))


def vision_attention(q: Tensor, k: Tensor, v: Tensor, packing: ImagePacking,
                     backends: Backends | None = None) -> Tensor:
    """Block-diagonal attention over packed images (the module docstring): q, k, v [T, H, D] -> [T, H, D], on the
    implementation the registry picks for q (op ``vision_attn``)."""
    return dispatch("vision_attn", q, backends).fn(q, k, v, packing, backends)
