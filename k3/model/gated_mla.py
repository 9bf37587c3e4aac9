"""Gated MLA with no positional encoding (report §2.1.2), parameter names as in the official checkpoint.

Two ablation arms, not K3 (config `mla_use_nope`, `mla_use_output_gate`): RoPE on the qk_rope_head_dim slice of
the queries and of the shared key dims (k3.ops.rope; the keys are rotated before the cache stores them, so every
attention form reads them as they are), and an ungated output o_proj(o) without g_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.cache import MLALayerCache
from k3.model.common import Linear, RMSNorm, stacked_linear
from k3.ops.mla import mla_absorbed, mla_attention, mla_attention_any, split_kv_b
from k3.ops.mla_decode import mla_decode_absorbed, paged_kernel_used
from k3.ops.mla_out import mla_gate_any
from k3.ops.registry import Backends, opaque, runs_on
from k3.ops.rms_norm_pair import rms_norm_pair_any
from k3.ops.rope import document_positions, rope


class GatedMLA(nn.Module):
    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = (self.dn + self.dr) ** -0.5
        self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)  # the release builds these two with eps 1e-6
        self.q_b_proj = Linear(cfg.q_lora_rank, H * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (self.dn + self.dv), bias=False)
        self.g_proj = Linear(D, H * self.dv, bias=False) if cfg.mla_use_output_gate else None
        self.o_proj = Linear(H * self.dv, D, bias=False)
        self.rope_theta = None if cfg.mla_use_nope else cfg.rope_theta  # the RoPE ablation's base, else None

    def projection_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The projections of x that `stacked_linear` computes together, in its order (k3.model.common)."""
        if self.g_proj is None:
            return ((self.q_a_proj, self.kv_a_proj_with_mqa),)
        return ((self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj),)

    def forward(self, x: torch.Tensor, cache: MLALayerCache | None = None, batch: BatchInfo | None = None,
                return_max_logit: bool = False):
        """x [B, T, D] -> [B, T, D]. `batch`: the batch's record (its segment ids keep each query in its own
        document). `cache`: a decode cache (k3.model.cache protocol), which stores the new latent rows and
        answers with the attention through one of this layer's forms (`expanded`, `absorbed`, `paged`). With
        `return_max_logit` (a forward without a cache), (output, each head's largest scaled pre-softmax logit [H]
        fp32, detached): QK-Clip's signal."""
        if return_max_logit and cache is not None:
            raise ValueError("return_max_logit is a training statistic: ask for it in a forward without a cache")
        B, T, _ = x.shape
        H, dn, dr, dv = self.num_heads, self.dn, self.dr, self.dv
        if self.g_proj is None:
            (q_a, kv_a), gate = stacked_linear(x, self.q_a_proj, self.kv_a_proj_with_mqa), None
        else:
            q_a, kv_a, gate = stacked_linear(x, self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj)  # one GEMM
        c, k_rope = kv_a.split([self.kv_rank, dr], dim=-1)
        q_a, c = self._norms(q_a, c)
        q = self.q_b_proj(q_a).view(B, T, H, dn + dr)
        if self.rope_theta is not None:
            q, k_rope = self._rotate(q, k_rope, self._positions(c, cache, batch))
        if cache is not None:
            attend_gated = getattr(cache, "attend_gated", None) if gate is not None else None
            if attend_gated is not None:  # the output gate inside the attention's last kernel where it can be
                return self.o_proj(attend_gated(self, q, c, k_rope, gate).reshape(B, T, -1))
            return self._gated_out(x, gate, cache.attend(self, q, c, k_rope))
        context = batch.context if batch is not None else None
        if context is not None:  # this segment's queries over the latent gathered from the earlier segments
            o = context.mla(q, c, k_rope, self.kv_b_proj, self.scale, batch.segment_ids,
                            return_max_logit=return_max_logit)
            if return_max_logit:  # this segment's maxima: the trainer's MAX over the ranks makes the row's
                o, top = o
                return self._gated_out(x, gate, o), top.detach()
            return self._gated_out(x, gate, o)
        # Training and evaluation forwards: expand the latent into per-head keys and values (compiled
        # flex_attention on GPU), documents kept apart by the batch's block mask, built once per batch.
        segment_ids = batch.segment_ids if batch is not None else None
        k, v = self._expand(c, k_rope)
        mask = batch.flex_block_mask if segment_ids is not None else None
        o = mla_attention_any(q, k, v, self.scale, segment_ids, return_max_logit=return_max_logit,
                              backends=self.backends, make_block_mask=mask)
        if return_max_logit:
            o, top = o
            return self._gated_out(x, gate, o), top.detach()
        return self._gated_out(x, gate, o)

    def _norms(self, q_a: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_a_layernorm(q_a), kv_a_layernorm(c)); without gradients as one kernel where the registry picks it (op
        ``rms_norm_pair``: one launch instead of two per layer and step)."""
        qn, kn = self.q_a_layernorm, self.kv_a_layernorm
        if not torch.is_grad_enabled() and runs_on("rms_norm_pair", "triton", q_a, self.backends):
            return rms_norm_pair_any(q_a, qn.weight, qn.eps, c, kn.weight, kn.eps, backends=self.backends)
        return qn(q_a), kn(c)

    def _positions(self, c: torch.Tensor, cache, batch: BatchInfo | None) -> torch.Tensor:
        """The RoPE positions [B, T] of this forward's tokens: where the cache puts them, else each token's place in
        its document (packed documents each start at 0)."""
        if cache is not None:
            return cache.token_positions(c)
        if batch is not None and batch.context is not None:
            raise ValueError("the RoPE ablation (mla_use_nope false) does not run under context parallelism: a "
                             "segment's positions depend on the earlier segments")
        if batch is not None and batch.segment_ids is not None:
            return document_positions(batch.segment_ids)
        B, T = c.shape[:2]
        return torch.arange(T, device=c.device).expand(B, T)

    def _rotate(self, q: torch.Tensor, k_rope: torch.Tensor, positions: torch.Tensor):
        """(q with its rope slice rotated, k_rope rotated) at `positions` [B, T] (the RoPE ablation)."""
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        q = torch.cat([q_nope, rope(q_rope, positions, self.rope_theta)], dim=-1)
        return q, rope(k_rope, positions, self.rope_theta)

    # --- the attention forms a cache picks from (k3.model.cache.LatentAttention) -------------------------------
    def _expand(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows -> per-head keys [B, T, H, dn + dr] and values [B, T, H, dv] (kv_b_proj)."""
        B, T, _ = c.shape
        H, dn, dr, dv = self.num_heads, self.dn, self.dr, self.dv
        k_nope, v = self.kv_b_proj(c).view(B, T, H, dn + dv).split([dn, dv], dim=-1)
        return torch.cat([k_nope, k_rope.unsqueeze(2).expand(B, T, H, dr)], dim=-1), v

    def expanded(self, q: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        k, v = self._expand(c, k_rope)
        return mla_attention(q, k, v, self.scale)

    def absorbed(self, q: torch.Tensor, c_all: torch.Tensor, kr_all: torch.Tensor, q_start, kv_len=None,
                 check: bool = True):
        w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.dn, self.dv)
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        return mla_absorbed(q_nope, q_rope, c_all, kr_all, w_kc, w_vc, self.scale, q_start=q_start, kv_len=kv_len,
                            check=check)

    def masked(self, q: torch.Tensor, c_all: torch.Tensor, kr_all: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, T, H, dn + dr] over the latent rows c_all [B, L, R] / kr_all [B, L, dr] that `mask`
        [B, T, L] (bool) lets each query see (at least one each), keys and values expanded per head, softmax in fp32:
        the reference form for an arbitrary visibility pattern (the EAGLE-3 training-time test, k3.posttrain.eagle3)."""
        k, v = self._expand(c_all, kr_all)
        s = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * self.scale
        s = s.masked_fill(~mask[:, None], float("-inf"))
        o = torch.einsum("bhtl,blhd->bthd", torch.softmax(s, dim=-1), v.float())
        return o.to(q.dtype)

    def paged(self, q: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
              num_splits: int | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
        """`gate` [B, T, H * dv]: the output gate applied too (`gated`), in the absorption's kernel where the
        registry picks op mla_combine_absorb_v_gate."""
        B, T = q.shape[:2]
        w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.dn, self.dv)
        q_nope, q_rope = q.reshape(B * T, self.num_heads, -1).split([self.dn, self.dr], dim=-1)
        # opaque to a compiled decode step (the engine's --compile-decode): Inductor cannot re-emit the Triton kernel
        o = opaque(mla_decode_absorbed)(q_nope, q_rope, pages, tables, lengths, w_kc, w_vc, self.scale,
                                        num_splits=num_splits, backends=self.backends,
                                        gate=None if gate is None else gate.reshape(B * T, -1))
        return o.view(B, T, self.num_heads, self.dv)

    def paged_kernel_used(self) -> bool:
        return paged_kernel_used(self.kv_b_proj.weight.device, self.backends)

    def gated(self, gate: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The output gate sigmoid(gate) * o of the attention o [B, T, H, dv], gate [B, T, H * dv] (op mla_gate):
        what an `attend_gated` returns where its form does not apply the gate itself."""
        B, T = gate.shape[:2]
        return mla_gate_any(gate, o.reshape(B, T, -1), o.dtype, backends=self.backends).view(o.shape)

    def _gated_out(self, x: torch.Tensor, gate: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
        """Output gate and projection: o_proj(sigmoid(gate) * o), gate = g_proj x, o of any shape [B, T, ...];
        o_proj(o) without a gate (the ungated ablation)."""
        B, T, _ = x.shape
        o = o.reshape(B, T, -1)
        if gate is None:
            return self.o_proj(o)
        return self.o_proj(mla_gate_any(gate, o, x.dtype, backends=self.backends))
