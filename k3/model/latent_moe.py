"""Stable LatentMoE (report §2.3): shared full-width experts + routed experts in a latent width.

    y = shared(x) + W_up RMSNorm( sum_{j in top-k} p_j E_j(W_down x) )

Routed experts are stored stacked ([E, F, L] and [E, L, F]) so they can be computed with grouped GEMMs and
orthogonalized per expert; checkpoint I/O maps them to the official `experts.{e}.w{1,2,3}` names.

The standard-MoE ablation (config `moe_latent` false, not K3) has no latent projection: the routed experts work in
the hidden width, y = shared(x) + sum_{j in top-k} p_j E_j(x) (no W_down, RMSNorm or W_up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.common import CastsWeights, Linear, RMSNorm, SituMLP, serving_stack, stacked_linear
from k3.ops.moe import Routing, interleaved_halves, moe_experts_any
from k3.ops.moe_gemv import fuses_norm, moe_gemv_for
from k3.ops.moe_out import moe_combine_norm_out_for, moe_out_for
from k3.ops.moe_route import route_any, route_round_any
from k3.ops.precision import autocast_off
from k3.ops.registry import Backends
from k3.ops.situ import situ_glu, situ_glu_any, situ_glu_any_fused


def fp32_out_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether one GEMM of `dtype` inputs on `device` can write fp32 outputs (aten ``mm.dtype``: CUDA, bf16/fp16)."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 a and b, accumulated and returned in fp32 (one GEMM)."""
    return torch.mm(a, b, out_dtype=torch.float32)


class MoEGate(nn.Module):
    """Sigmoid router. The score-correction bias is set by Quantile Balancing, not by gradients. Forwards without
    gradients route through op ``moe_route`` (k3.ops.moe_route: one kernel on its fast path)."""

    backends: Backends | None = None  # which implementation routes (K3ForCausalLM.set_backends)

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, scaling: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling

    def forward(self, x: torch.Tensor) -> Routing:
        with autocast_off(x.device.type):
            logits = F.linear(x.float(), self.weight.float())  # router in fp32 (report §2.3.3), autocast or not
        return self.from_logits(logits)

    def from_logits(self, logits: torch.Tensor) -> Routing:
        """The routing of the router's fp32 logits [N, E]."""
        return route_any(logits, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling,
                         backends=self.backends)

    def route_round(self, y: torch.Tensor, dtype: torch.dtype) -> tuple[Routing, torch.Tensor]:
        """For y [N, E + R] fp32, the router's logits then R other columns (one GEMM's output): the routing of the
        logits and the other columns rounded to `dtype` (op ``moe_route_round``: one kernel where it runs)."""
        return route_round_any(y, self.weight.shape[0], self.e_score_correction_bias, self.top_k, self.renormalize,
                               self.scaling, dtype, backends=self.backends)


class GroupedExperts(CastsWeights, nn.Module):
    """The routed experts: E independent SiTU-GLU FFNs of width latent -> F -> latent."""

    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, num_experts: int, latent: int, inter: int, beta1: float, beta2: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, latent))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, latent))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, inter))  # down
        self.beta1, self.beta2 = beta1, beta2

    def stack_halves(self, on: bool = True) -> bool:
        """For serving (k3.model.common.stack_projections): w1 and w3 moved, in place, into the two halves of one
        [E, 2F, L] tensor per expert (the same Parameter objects, values and memory), so that the grouped path
        computes gate and up as one grouped GEMM (k3.ops.moe.interleaved_halves); `on=False` gives each its own
        contiguous tensor again. Returns whether they are stacked afterwards."""
        w1, w3 = self.w1, self.w3
        stacked = interleaved_halves(w1.data, w3.data) is not None
        if on and not stacked and w1.shape == w3.shape and w1.dtype == w3.dtype and w1.device == w3.device:
            F = w1.shape[1]
            buf = torch.empty((w1.shape[0], 2 * F, w1.shape[2]), dtype=w1.dtype, device=w1.device)
            buf[:, :F].copy_(w1.data)
            buf[:, F:].copy_(w3.data)
            w1.data, w3.data = buf[:, :F], buf[:, F:]
        elif not on and stacked:
            w1.data, w3.data = w1.data.contiguous(), w3.data.contiguous()
        return interleaved_halves(w1.data, w3.data) is not None

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ_glu(gate, up, self.beta1, self.beta2)

    def act_fused(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiTU-GLU on the implementation the registry picks (the fused Triton kernel on GPU)."""
        return situ_glu_any(gate, up, self.beta1, self.beta2, backends=self.backends)

    def act_fused13(self, h13: torch.Tensor) -> torch.Tensor:
        """SiTU-GLU of [gate | up] columns on the implementation the registry picks."""
        return situ_glu_any_fused(h13, self.beta1, self.beta2, backends=self.backends)

    def forward(self, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        # a decode step's few tokens without gradients: the GEMV kernels where the registry picks them (op moe_gemv);
        # otherwise the reference expert loop with the reference SiTU-GLU, or grouped GEMMs with the fused one (in
        # training under autocast, with the step's weight casts, w1 and w3 stacked once per step, one GEMM for both:
        # k3.ops.weight_cast)
        gemv = moe_gemv_for(z, self.backends)
        if gemv is not None:
            return gemv(z, routing.weights, routing.indices, self.w1, self.w3, self.w2, self.beta1, self.beta2,
                        backends=self.backends)
        return moe_experts_any(z, routing.weights, routing.indices, self.w1, self.w3, self.w2, self.act,
                               self.act_fused, self.act_fused13, backends=self.backends, casts=self.weight_casts)

    def forward_normed(self, z: torch.Tensor, routing: Routing, norm: RMSNorm) -> torch.Tensor | None:
        """norm(self(z, routing)) with the norm inside the GEMV path's combine kernel, where the registry picks both
        (ops ``moe_gemv`` and ``moe_combine_norm``: one kernel fewer per layer and step); None otherwise, and for
        subclasses that compute the experts another way (MX QAT, expert parallelism): the caller norms."""
        if not fuses_norm(z, self.backends):
            return None
        return self._gemv_only(z, routing, norm=(norm.weight, norm.eps))

    def forward_pairs(self, z: torch.Tensor, routing: Routing) -> torch.Tensor | None:
        """The experts' outputs y [N*k, L] before their combine (pairs in token order), from the GEMV path where the
        registry picks it, for a kernel that combines them itself (op ``moe_combine_norm_out``); None otherwise, and
        for subclasses that compute the experts another way."""
        return self._gemv_only(z, routing, pairs=True)

    def _gemv_only(self, z: torch.Tensor, routing: Routing, **how) -> torch.Tensor | None:
        """The GEMV path's kernels with `how` (k3.ops.moe_gemv.moe_gemv_triton's norm or pairs) where the registry
        picks them and this class computes the experts as GroupedExperts does; else None."""
        if type(self).forward is not GroupedExperts.forward:
            return None
        gemv = moe_gemv_for(z, self.backends)
        if gemv is None:
            return None
        return gemv(z, routing.weights, routing.indices, self.w1, self.w3, self.w2, self.beta1, self.beta2,
                    backends=self.backends, **how)


class LatentMoE(nn.Module):
    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        self.latent = cfg.moe_latent  # false: the standard-MoE ablation, experts in the hidden width
        D, L = cfg.hidden_size, (cfg.routed_expert_hidden_size if self.latent else cfg.hidden_size)
        self.layer_idx = layer_idx
        self.gate = MoEGate(D, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize,
                            cfg.routed_scaling_factor)
        if self.latent:
            self.routed_expert_down_proj = Linear(D, L, bias=False)
            self.routed_expert_norm = RMSNorm(L, eps=cfg.rms_norm_eps) if cfg.latent_moe_use_norm else nn.Identity()
            self.routed_expert_up_proj = Linear(L, D, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, L, cfg.moe_intermediate_size,
                                      cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.shared_experts = (
            SituMLP(D, cfg.shared_intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
            if cfg.num_shared_experts > 0 else None
        )

    def projection_groups(self) -> tuple[tuple[nn.Module, ...], ...]:
        """The projections of x computed together once stacked for serving (k3.model.common.stack_projections):
        the latent down-projection and the shared experts' gate and up, and on CUDA the router in front of them
        (report §5.4.2: one GEMM with fp32 output, the router's logits exact as in fp32 and the rest rounded as a
        bf16 GEMM rounds)."""
        if self.shared_experts is None:
            return ()
        w = self.gate.weight
        head = (self.gate,) if fp32_out_gemm(w.device, w.dtype) else ()
        return (head + self._down() + (self.shared_experts.gate_proj, self.shared_experts.up_proj),)

    def _down(self) -> tuple[nn.Module, ...]:
        """The latent down-projection, as a tuple of one (none in the standard-MoE ablation)."""
        return (self.routed_expert_down_proj,) if self.latent else ()

    def _routed(self, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum u of z, back to the hidden width: W_up RMSNorm(u) (u itself without the
        latent)."""
        return self.routed_expert_up_proj(self._normed(z, routing)) if self.latent else self.experts(z, routing)

    def _normed(self, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        """RMSNorm(u) of the routed experts' weighted sum u of z (latent only); the norm inside the experts' last
        kernel where they can (GroupedExperts.forward_normed)."""
        norm = self.routed_expert_norm
        a = None
        if isinstance(norm, RMSNorm) and hasattr(self.experts, "forward_normed"):
            a = self.experts.forward_normed(z, routing, norm)
        return norm(self.experts(z, routing)) if a is None else a

    def _out_kernel(self, z: torch.Tensor, sg: torch.Tensor):
        """The MoE output kernel's function (op ``moe_out``: the latent up-projection, the shared experts' SiTU-GLU
        and down-projection and their sum in one kernel) where the registry picks it for these few tokens and the two
        projections are plain bias-free linears of the activations' dtype; else None."""
        up, down = self.routed_expert_up_proj, self.shared_experts.down_proj
        if any(m.bias is not None or getattr(m, "weight_casts", None) is not None or m.weight.dtype != sg.dtype
               for m in (up, down)):
            return None
        return moe_out_for(z, self.backends)

    def _pairs_out(self, z: torch.Tensor, routing: Routing, sg: torch.Tensor, su: torch.Tensor
                   ) -> torch.Tensor | None:
        """The layer's output with the experts' combine and latent norm inside the MoE output kernel (op
        ``moe_combine_norm_out``: one kernel fewer per layer and step) where the registry picks it and the experts
        hand over their pairs (GroupedExperts.forward_pairs); else None (the caller runs the two kernels)."""
        norm = self.routed_expert_norm
        kernel = moe_combine_norm_out_for(z, self.backends) if isinstance(norm, RMSNorm) else None
        pairs = getattr(self.experts, "forward_pairs", None) if kernel is not None else None
        y = pairs(z, routing) if pairs is not None else None
        if y is None:
            return None
        sh = self.shared_experts
        return kernel(y, routing.weights, norm.weight, norm.eps, sg, su, self.routed_expert_up_proj.weight,
                      sh.down_proj.weight, sh.beta1, sh.beta2)

    def _stacked_projections(self, flat: torch.Tensor):
        """(the routing, or None: the router runs on its own; z; shared gate; shared up) from one GEMM against the
        serving stack, or None where there is none (training, unstacked)."""
        if torch.is_grad_enabled() or self.shared_experts is None:
            return None
        sh = self.shared_experts
        rest = (*self._down(), sh.gate_proj, sh.up_proj)
        sizes = [m.out_features for m in rest]
        stack = serving_stack(self.gate, *rest) if fp32_out_gemm(flat.device, flat.dtype) else None
        if stack is not None:
            E = self.gate.weight.shape[0]
            y = mm_fp32_out(flat, stack.t())
            # the routing, and the other projections rounded to the input's dtype (as a bf16 GEMM rounds them): in
            # the router's kernel where the registry picks op moe_route_round
            routing, others = self.gate.route_round(y[:, :E + sum(sizes)], flat.dtype)
            out = (routing, *others.split(sizes, dim=-1))
        elif serving_stack(*rest) is None:
            return None
        else:
            out = (None, *stacked_linear(flat, *rest))
        return out if self.latent else (out[0], flat, *out[1:])  # z: x itself without the latent

    def forward(self, x: torch.Tensor, return_routing: bool = False):
        """y [..., D] for x [..., D]; with `return_routing`, (y, the routing of the flattened tokens, detached):
        what load balancing and the expert-load metrics read."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        stacked = self._stacked_projections(flat)
        if stacked is not None:  # serving: the projections of x from one GEMM
            routing, z, sg, su = stacked
            routing = self.gate(flat) if routing is None else routing
            fused = self._out_kernel(z, sg) if self.latent else None
            if fused is not None:  # W_up a, SiTU-GLU, W_down h and their sum in one kernel (op moe_out)
                sh = self.shared_experts
                y = self._pairs_out(z, routing, sg, su)
                if y is None:
                    y = fused(self._normed(z, routing), sg, su, self.routed_expert_up_proj.weight,
                              sh.down_proj.weight, sh.beta1, sh.beta2)
            else:  # the routed output added in the shared experts' down-projection GEMM (its epilogue)
                y = self.shared_experts.from_projections(sg, su, add=self._routed(z, routing))
            return (y.view(shape), Routing(*(t.detach() for t in routing))) if return_routing else y.view(shape)
        routing = self.gate(flat)
        y = self._routed(self.routed_expert_down_proj(flat) if self.latent else flat, routing)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if return_routing:
            return y.view(shape), Routing(*(t.detach() for t in routing))
        return y.view(shape)
