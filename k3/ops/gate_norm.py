"""KDA's output normalization and gate: RMSNorm over each head's channels, times sigmoid of the output gate.

    y = RMSNorm_w(o) * sigmoid(g)        (fp32 arithmetic; o, g: [..., K], w: [K])

The reference (:func:`gate_norm_torch`) is the model's own RMSNorm module math on o upcast to fp32, then the gate:
about eight passes over an fp32 [tokens, H*K] tensor forward and more backward. The fast backend is fla-core's
``rms_norm_gated`` (activation ``sigmoid``): one Triton kernel forward and one backward, computing in fp32 and
returning y in o's dtype (the reference returns fp32; the layer's output projection rounds either to its compute
dtype, so both give the same bf16 input to that GEMM up to fp32 rounding).

:func:`gate_norm` picks the implementation through k3.ops.backend (op ``gate_norm``,
K3_GATE_NORM_BACKEND=auto|torch|fla).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops.backend import importable, resolve

__all__ = ["gate_norm", "gate_norm_fla", "gate_norm_torch"]


def _check(o: Tensor, g: Tensor, weight: Tensor) -> None:
    if o.shape != g.shape:
        raise ValueError(f"o and g must have the same shape, got {tuple(o.shape)} and {tuple(g.shape)}")
    if weight.shape != (o.shape[-1],):
        raise ValueError(f"weight must have shape [{o.shape[-1]}] (o's last dimension), got {tuple(weight.shape)}")


def gate_norm_torch(o: Tensor, g: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Reference: o * rsqrt(mean(o^2) + eps) * weight * sigmoid(g), all in fp32; returns fp32."""
    _check(o, g, weight)
    y = F.rms_norm(o.float(), (o.shape[-1],), weight.float(), eps=eps)
    return y * torch.sigmoid(g.float())


def gate_norm_fla(o: Tensor, g: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fla-core's fused gated RMSNorm (one kernel each way); returns o's dtype."""
    _check(o, g, weight)
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, g, weight, None, activation="sigmoid", eps=eps)


def gate_norm(o: Tensor, g: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:func:`gate_norm_torch` or :func:`gate_norm_fla`, as k3.ops.backend decides for o's device."""
    if resolve("gate_norm", o.device, lambda: importable("fla.modules.norm.fused_norm_gate")) == "fla":
        return gate_norm_fla(o, g, weight, eps)
    return gate_norm_torch(o, g, weight, eps)
