"""Rotary position embedding (RoFormer; the rotate-half form of GPT-NeoX and Llama), for the RoPE ablation of Gated
MLA (config `mla_use_nope` false). K3 itself has no positional encoding: its MLA is NoPE (report §2.1.2).

With x = [x1, x2] split into halves of d / 2 dims, frequencies f_i = theta^(-2i / d) and angles a_i = p * f_i at
position p:

    rope(x, p) = [x1 cos(a) - x2 sin(a),  x2 cos(a) + x1 sin(a)]

so q_p . k_s depends on the positions only through p - s. Computed in fp32 (angles included, as transformers does),
returned in x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [B, T, ..., d] (d even) rotated at integer positions [B, T] (broadcast over the dims between T and d)."""
    d = x.shape[-1]
    if d % 2 or positions.shape != x.shape[:2]:
        raise ValueError(f"rope needs x [B, T, ..., d] with d even and positions [B, T]: got x {tuple(x.shape)}, "
                         f"positions {tuple(positions.shape)}")
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # [d / 2]
    angle = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, d / 2]
    angle = angle.view(*angle.shape[:2], *([1] * (x.ndim - 3)), d // 2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def document_positions(segment_ids: Tensor) -> Tensor:
    """Each token's position within its document [B, T] (0 where a row starts or the segment id changes): the
    positions of packed documents, each as if it were alone."""
    B, T = segment_ids.shape
    idx = torch.arange(T, device=segment_ids.device).expand(B, T)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return idx - torch.where(start, idx, 0).cummax(dim=1).values
