"""SiTU-GLU: the bounded gated activation of the K3 feed-forward experts (report §2.3.2, appendix B).

SwiGLU computes ``silu(gate) * up``. Both factors are unbounded, so a few outlier
activations can grow without limit; that is what breaks low-precision (MXFP8/MXFP4)
training and inference. SiTU-GLU soft-caps each factor with a scaled tanh:

    situ_glu(gate, up) = [beta1 * tanh(gate / beta1) * sigmoid(gate)] * [beta2 * tanh(up / beta2)]

Near the origin ``beta * tanh(x / beta) = x + O(x^3 / beta^2)``, so it behaves like
SwiGLU there; far from it the output is bounded by ``beta1 * beta2`` in magnitude.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["situ_glu", "situ_glu_any", "situ_glu_any_fused"]


def situ_glu(gate: Tensor, up: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """Bounded GLU: ``beta1*tanh(gate/beta1)*sigmoid(gate) * beta2*tanh(up/beta2)``.

    Args:
        gate: [..., F] gate projection (any floating dtype).
        up: [..., F] up projection, same shape as ``gate``.
        beta1: soft cap of the gate branch (report appendix B: 4).
        beta2: soft cap of the up branch (report appendix B: 25).

    Returns:
        [..., F] in ``gate.dtype``; computed in fp32 (float64 stays float64).
    """
    if not torch.is_floating_point(gate):
        raise ValueError(f"gate must be a floating tensor, got dtype {gate.dtype}")
    if not torch.is_floating_point(up):
        raise ValueError(f"up must be a floating tensor, got dtype {up.dtype}")
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got gate {tuple(gate.shape)} and up {tuple(up.shape)}"
        )
    if not beta1 > 0:
        raise ValueError(f"beta1 must be > 0, got {beta1}")
    if not beta2 > 0:
        raise ValueError(f"beta2 must be > 0, got {beta2}")

    # fp32 at least: tanh/sigmoid of bf16 inputs lose the small-|x| behaviour that makes
    # the activation match SwiGLU near 0 (§2.3.2); float64 is kept for gradcheck.
    compute = torch.promote_types(torch.promote_types(gate.dtype, up.dtype), torch.float32)
    g = gate.to(compute)
    u = up.to(compute)

    gate_branch = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)  # |.| < beta1
    up_branch = beta2 * torch.tanh(u / beta2)  # |.| < beta2
    return (gate_branch * up_branch).to(gate.dtype)


def _triton_available(x: Tensor) -> tuple[bool, str]:
    from k3.ops import situ_triton

    if x.dtype == torch.float64:
        return False, "the Triton kernel takes fp32/bf16/fp16 (float64 runs on the reference)"
    return situ_triton.available()


def situ_glu_any(gate: Tensor, up: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """``situ_glu`` on the backend k3.ops.backend picks for this device (the fused Triton kernel on GPU)."""
    from k3.ops.backend import resolve

    if resolve("situ", gate.device, lambda: _triton_available(gate)) == "triton":
        from k3.ops.situ_triton import situ_glu_split

        return situ_glu_split(gate, up, beta1, beta2)
    return situ_glu(gate, up, beta1, beta2)


def situ_glu_any_fused(h13: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """``situ_glu(h13[..., :F], h13[..., F:])`` of a [gate | up] tensor on the backend k3.ops.backend picks (the
    fused Triton kernel on GPU, whose backward writes d(h13) as one tensor)."""
    from k3.ops.backend import resolve

    if h13.shape[-1] % 2:
        raise ValueError(f"h13's last dimension must be even ([gate | up], 2F columns), got {h13.shape[-1]}")
    if resolve("situ", h13.device, lambda: _triton_available(h13)) == "triton":
        from k3.ops.situ_triton import situ_glu_fused

        return situ_glu_fused(h13, beta1, beta2)
    gate, up = h13.chunk(2, dim=-1)
    return situ_glu(gate, up, beta1, beta2)
