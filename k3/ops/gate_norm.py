"""KDA's output normalization and gate: RMSNorm over each head's channels, times sigmoid of the output gate.

    y = RMSNorm_w(o) * sigmoid(g)        (fp32 arithmetic; o, g: [..., K], w: [K])

The reference (:func:`gate_norm_torch`) is the model's own RMSNorm module math on o upcast to fp32, then the gate:
about eight passes over an fp32 [tokens, H*K] tensor forward and more backward. The fast backend is fla-core's
``rms_norm_gated`` (activation ``sigmoid``): one Triton kernel forward and one backward, computing in fp32 and
returning y in o's dtype (the reference returns fp32; the layer's output projection rounds either to its compute
dtype, so both give the same bf16 input to that GEMM up to fp32 rounding).

:func:`gate_norm` picks the implementation through k3.ops.registry (op ``gate_norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops.registry import Backends, Fast, Op, Target, dispatch, importable, register

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


def fla_available(target: Target) -> tuple[bool, str]:
    return importable("fla.modules.norm.fused_norm_gate")


register(Op(
    "gate_norm", reference=gate_norm_torch,
    fast=(Fast("fla", gate_norm_fla, fla_available, validated=True),),
    tolerance="bf16: 2e-2 of the largest reference entry (one rounding of y and of each gradient); fp32: 1e-5"))


def gate_norm(o: Tensor, g: Tensor, weight: Tensor, eps: float, backends: Backends | None = None) -> Tensor:
    """:func:`gate_norm_torch` or :func:`gate_norm_fla`, as the registry picks for o (op ``gate_norm``)."""
    return dispatch("gate_norm", o, backends).fn(o, g, weight, eps)
