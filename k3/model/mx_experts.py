"""Routed experts computed in the MX formats of deployment (report §4.1.4): MXFP4 weights, MXFP8 inputs.

K3 is served with its routed experts' weights in MXFP4 (E2M1 values, one E8M0 scale per 32) and the inputs of
the experts' GEMMs in MXFP8 (E4M3, one scale per 32 along the contraction dimension); attention, the latent
projections, the shared experts and the router stay in high precision. `MXExperts` is a `GroupedExperts` that
computes the same SiTU-GLU experts with

* its weights fake-quantized to MXFP4 in every forward (`weights="mxfp4"`: quantization-aware training, with a
  straight-through gradient into the high-precision master weights), or taken as they are (`weights=None`: a
  loaded MXFP4 checkpoint, whose decoded weights are already exactly representable);
* the input of each expert GEMM fake-quantized to MXFP8 (`activations="mxfp8"`): the latent z before w1 and w3,
  the SiTU-GLU output before w2, each per token in blocks of 32 along the contracted dimension, as an MX GEMM
  reads them; straight-through in backward.

Every rounding is the exact encoder of k3.ops.mx, so a QAT training forward and the served MXFP4 checkpoint
compute the same values. `quantize_experts(model, ...)` wraps every LatentMoE's experts from outside; the
parameters are the same tensors under the same names, so checkpoints, the optimizer's per-expert rule and
weight casts see the model unchanged.

`PackedMXExperts` is the served form of an MXFP4 checkpoint: the experts stay in the release's storage in memory
(`weight_packed` / `weight_scale`, stacked per layer as buffers `w{1,3,2}_packed` / `w{1,3,2}_scale`) and are
decoded inside the expert computation (k3.ops.mx_moe), so they take a quarter of bf16's memory and a decode step
reads a quarter of the bytes. `k3.checkpoint.from_pretrained(..., packed_experts=True)` builds it (what `k3 serve`
does for MXFP4 checkpoints); `pack_experts(model)` converts a loaded model whose expert weights are
MXFP4-exact (a dequantized MXFP4 checkpoint) in place. It has no parameters: it serves, it does not train.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.model.latent_moe import GroupedExperts, LatentMoE
from k3.ops.moe import Routing, moe_experts_any
from k3.ops.mx import MX_BLOCK, mxfp4_fake_quantize_any, mxfp4_quantize, mxfp8_fake_quantize_any
from k3.ops.mx_moe import PackedExpertWeights, mx_moe_packed_any, mx_moe_packed_triton, takes_gemv
from k3.ops.registry import Backends, dispatch

WEIGHT_FORMATS = (None, "mxfp4")
ACTIVATION_FORMATS = (None, "mxfp8")


class MXExperts(GroupedExperts):
    """The routed experts of `experts` (the same parameters) computed with MX weights and/or activations."""

    def __init__(self, experts: GroupedExperts, weights: str | None = "mxfp4", activations: str | None = "mxfp8"):
        nn.Module.__init__(self)  # not GroupedExperts': the parameters are the given module's own
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={weights!r} is invalid: use one of {WEIGHT_FORMATS}")
        if activations not in ACTIVATION_FORMATS:
            raise ValueError(f"activations={activations!r} is invalid: use one of {ACTIVATION_FORMATS}")
        E, F, L = experts.w1.shape
        if L % MX_BLOCK or F % MX_BLOCK:
            raise ValueError(f"MX experts need the latent width ({L}) and the expert width ({F}) to be multiples of "
                             f"{MX_BLOCK} (one scale per {MX_BLOCK} along each GEMM's contracted dimension)")
        self.w1, self.w3, self.w2 = experts.w1, experts.w3, experts.w2
        self.beta1, self.beta2 = experts.beta1, experts.beta2
        self.backends = experts.backends
        self.weight_casts = experts.weight_casts
        self.weights, self.activations = weights, activations

    def _act_in(self, x):
        return mxfp8_fake_quantize_any(x, self.backends) if self.activations == "mxfp8" else x

    def forward(self, z, routing: Routing):
        w1, w3, w2 = self.w1, self.w3, self.w2
        if self.weights == "mxfp4":
            # Blocks of 32 along the last dim: the input dim of [out, in] ([E, F, L] and [E, L, F]), as on disk.
            w1, w3, w2 = (mxfp4_fake_quantize_any(w, self.backends) for w in (w1, w3, w2))
        dt = z.dtype
        z = self._act_in(z)
        # The hidden is cast to the GEMM dtype, then rounded: what the w2 GEMM reads.
        act = lambda g, u: self._act_in(self.act(g, u).to(dt))  # noqa: E731
        act_fused = lambda g, u: self._act_in(self.act_fused(g, u).to(dt))  # noqa: E731
        act13 = lambda h: self._act_in(self.act_fused13(h).to(dt))  # noqa: E731
        return moe_experts_any(z, routing.weights, routing.indices, w1, w3, w2, act, act_fused, act13,
                               backends=self.backends, casts=self.weight_casts)

    def extra_repr(self) -> str:
        return f"weights={self.weights}, activations={self.activations}"


def quantize_experts(model: nn.Module, weights: str | None = "mxfp4", activations: str | None = "mxfp8") -> nn.Module:
    """Make every LatentMoE of `model` (backbone and MTP) compute its routed experts in the given formats; both
    None restores plain `GroupedExperts`. Packed experts (`PackedMXExperts`) are left as they are. Nothing else
    changes: the experts' parameters stay the same tensors, every other module is untouched. Returns `model`."""
    for m in model.modules():
        if not isinstance(m, LatentMoE) or isinstance(m.experts, PackedMXExperts):
            continue  # packed experts hold their own formats
        ex = m.experts
        if type(ex) not in (GroupedExperts, MXExperts):
            raise ValueError(f"cannot quantize {type(ex).__name__} experts (apply quantization before parallelizing)")
        if weights is None and activations is None:
            plain = GroupedExperts.__new__(GroupedExperts)
            nn.Module.__init__(plain)
            plain.w1, plain.w3, plain.w2 = ex.w1, ex.w3, ex.w2
            plain.beta1, plain.beta2, plain.backends = ex.beta1, ex.beta2, ex.backends
            plain.weight_casts = ex.weight_casts
            m.experts = plain
        else:
            m.experts = MXExperts(ex, weights, activations)
    return model


def expert_formats(model: nn.Module) -> tuple[str | None, str | None]:
    """(weights, activations) of the model's routed experts; (None, None) when they are plain. Packed experts
    (`PackedMXExperts`) are ("mxfp4", their activations): their weights are MXFP4 values."""
    for m in model.modules():
        if isinstance(m, MXExperts):
            return m.weights, m.activations
        if isinstance(m, PackedMXExperts):
            return "mxfp4", m.activations
    return None, None


_PACKED = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")


class PackedMXExperts(nn.Module):
    """The routed experts held in MXFP4 storage (uint8 buffers, see the module docstring), computed by op
    ``mx_moe`` (k3.ops.mx_moe) with the expert GEMMs' inputs in `activations` ("mxfp8" or None)."""

    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, num_experts: int, latent: int, inter: int, beta1: float, beta2: float,
                 activations: str | None = "mxfp8", device=None):
        super().__init__()
        if activations not in ACTIVATION_FORMATS:
            raise ValueError(f"activations={activations!r} is invalid: use one of {ACTIVATION_FORMATS}")
        if latent % MX_BLOCK or inter % MX_BLOCK:
            raise ValueError(f"MXFP4 experts need the latent width ({latent}) and the expert width ({inter}) to be "
                             f"multiples of {MX_BLOCK}")
        E, F, L = num_experts, inter, latent
        shapes = {"w1": (E, F, L), "w3": (E, F, L), "w2": (E, L, F)}
        for w, (e, out, inp) in shapes.items():
            self.register_buffer(f"{w}_packed", torch.zeros(e, out, inp // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{w}_scale", torch.zeros(e, out, inp // MX_BLOCK, dtype=torch.uint8, device=device))
        self.beta1, self.beta2, self.activations = beta1, beta2, activations

    @property
    def packed(self) -> PackedExpertWeights:
        return PackedExpertWeights(*(getattr(self, n) for n in _PACKED))

    def forward(self, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        return mx_moe_packed_any(z, routing.weights, routing.indices, self.packed, self.beta1, self.beta2,
                                 self.activations, backends=self.backends)

    def forward_pairs(self, z: torch.Tensor, routing: Routing) -> torch.Tensor | None:
        """The experts' outputs y [N*k, L] before their combine (pairs in token order, z's dtype) where op ``mx_moe``
        runs these tokens on the token-centric kernels (``triton``; ``triton_grouped`` where k3.ops.mx_moe.takes_gemv
        says), for a kernel that combines them itself (op ``moe_combine_norm_out``); else None (the caller
        combines)."""
        if torch.is_grad_enabled() or z.ndim != 2:
            return None
        name = dispatch("mx_moe", z, self.backends).name
        E = self.packed.shape[0]
        if name != "triton" and not (name == "triton_grouped" and takes_gemv(z.shape[0], routing.indices.shape[1], E)):
            return None
        return mx_moe_packed_triton(z, routing.weights, routing.indices, self.packed, self.beta1, self.beta2,
                                    self.activations, pairs=True)

    def extra_repr(self) -> str:
        E, F, L = self.packed.shape
        return f"experts={E}, latent={L}, inter={F}, weights=mxfp4 (packed), activations={self.activations}"


def packed_experts_layout(model: nn.Module, activations: str | None = "mxfp8") -> nn.Module:
    """Give every LatentMoE of `model` empty `PackedMXExperts` in place of its experts (on the experts' device, the
    meta device included): the structure a packed MXFP4 checkpoint loads into. Returns `model`."""
    for m in model.modules():
        if isinstance(m, LatentMoE) and not isinstance(m.experts, PackedMXExperts):
            m.experts = _packed_like(m.experts, activations)
    return model


def _packed_like(ex: GroupedExperts, activations: str | None) -> PackedMXExperts:
    """Empty packed experts of `ex`'s shape, SiTU caps, backends and device."""
    E, F, L = ex.w1.shape
    packed = PackedMXExperts(E, L, F, ex.beta1, ex.beta2, activations, device=ex.w1.device)
    packed.backends = ex.backends
    return packed


@torch.no_grad()
def pack_experts(model: nn.Module, activations: str | None = "mxfp8") -> nn.Module:
    """Hold every LatentMoE's routed experts in MXFP4 storage (`PackedMXExperts`), encoding their weights
    (k3.ops.mx.mxfp4_quantize: exact for weights that are MXFP4 values already, such as a dequantized MXFP4
    checkpoint's; others are rounded as the MXFP4 export rounds them). Returns `model`."""
    for m in model.modules():
        if isinstance(m, LatentMoE) and not isinstance(m.experts, PackedMXExperts):
            packed = _packed_like(m.experts, activations)
            for w in ("w1", "w3", "w2"):
                codes, scale = mxfp4_quantize(getattr(m.experts, w).float())
                getattr(packed, f"{w}_packed").copy_(codes)
                getattr(packed, f"{w}_scale").copy_(scale)
            m.experts = packed
    return model
