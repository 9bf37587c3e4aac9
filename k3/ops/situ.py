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

from k3.ops import _triton, situ_triton
from k3.ops.registry import DEFAULT, Backends, Fast, Op, Target, dispatch, keep_opaque, opaque, register

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


def triton_available(target: Target) -> tuple[bool, str]:
    if target.dtype == torch.float64:
        return False, "the Triton kernel takes fp32/bf16/fp16 (float64 runs on the reference)"
    return _triton.available(target)


register(Op(
    "situ", reference=situ_glu,
    fast=(Fast("triton", situ_triton.situ_glu_split, triton_available, validated=True),),
    tolerance="fp32: 1e-5 against a float64 evaluation (the kernel builds tanh and sigmoid from exponentials, "
              "exact to ~1e-6); bf16/fp16: half an ulp of the output rounding (2^-8 / 2^-11) plus that, a whole "
              "ulp in the interpreter, which truncates",
    options=("situ_autotune",)))


def situ_glu_any(gate: Tensor, up: Tensor, beta1: float = 4.0, beta2: float = 25.0,
                 backends: Backends | None = None) -> Tensor:
    """``situ_glu`` on the implementation the registry picks for `gate` under `backends` (op ``situ``: the fused
    Triton kernel on GPU)."""
    impl = dispatch("situ", gate, backends)
    if impl.name == "triton":
        return impl.fn(gate, up, beta1, beta2, autotune=(backends or DEFAULT).situ_autotune)
    return impl.fn(gate, up, beta1, beta2)


def situ_glu_any_fused(h13: Tensor, beta1: float = 4.0, beta2: float = 25.0,
                       backends: Backends | None = None) -> Tensor:
    """``situ_glu(h13[..., :F], h13[..., F:])`` of a [gate | up] tensor on the implementation the registry picks
    (op ``situ``: the fused Triton kernel on GPU, whose backward writes d(h13) as one tensor)."""
    if h13.shape[-1] % 2:
        raise ValueError(f"h13's last dimension must be even ([gate | up], 2F columns), got {h13.shape[-1]}")
    impl = dispatch("situ", h13, backends)
    if impl.name == "triton":
        return opaque(_situ_glu_fused)(h13, beta1, beta2, autotune=(backends or DEFAULT).situ_autotune)
    gate, up = h13.chunk(2, dim=-1)
    return impl.fn(gate, up, beta1, beta2)


_situ_glu_fused = keep_opaque(situ_triton.situ_glu_fused)
