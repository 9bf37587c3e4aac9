"""Gated MLA with no positional encoding (report §2.1.2), parameter names as in the official checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.common import Linear, RMSNorm, stacked_linear
from k3.ops.mla import mla_absorbed, mla_attention, mla_attention_any, split_kv_b
from k3.ops.mla_decode import paged_kernel_used
from k3.ops.registry import Backends


class MLACache:
    """One MLA layer's decode cache: the normalized latent c and the shared extra key dims, per token."""

    def __init__(self) -> None:
        self.c: torch.Tensor | None = None  # [B, L, kv_lora_rank]
        self.k_rope: torch.Tensor | None = None  # [B, L, qk_rope_head_dim]

    @property
    def length(self) -> int:
        return 0 if self.c is None else self.c.shape[1]

    def append(self, c: torch.Tensor, k_rope: torch.Tensor):
        """Add the new tokens' entries; returns (c_all, k_rope_all, past, kv_len) where `past` is the number of
        tokens cached before this call (int, or LongTensor [B] for a batch of different lengths) and `kv_len` the
        valid length of each row of the returned tensors (None: all rows full). A paged serving cache implements
        the same method."""
        past = self.length
        if self.c is None:
            self.c, self.k_rope = c, k_rope
        else:
            self.c = torch.cat([self.c, c], dim=1)
            self.k_rope = torch.cat([self.k_rope, k_rope], dim=1)
        return self.c, self.k_rope, past, None


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
        self.g_proj = Linear(D, H * self.dv, bias=False)
        self.o_proj = Linear(H * self.dv, D, bias=False)

    def forward(self, x: torch.Tensor, cache: MLACache | None = None, batch: BatchInfo | None = None,
                return_max_logit: bool = False):
        """x [B, T, D] -> [B, T, D]. `batch`: the batch's record (its segment ids keep each query in its own
        document). With `return_max_logit` (a forward without a cache), (output, each head's largest scaled
        pre-softmax logit [H] fp32, detached): QK-Clip's signal."""
        if return_max_logit and cache is not None:
            raise ValueError("return_max_logit is a training statistic: ask for it in a forward without a cache")
        segment_ids = batch.segment_ids if batch is not None else None
        B, T, _ = x.shape
        H, dn, dr, dv = self.num_heads, self.dn, self.dr, self.dv
        q_a, kv_a, gate = stacked_linear(x, self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj)  # one GEMM
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(B, T, H, dn + dr)
        c, k_rope = kv_a.split([self.kv_rank, dr], dim=-1)
        c = self.kv_a_layernorm(c)
        past, kv_len = 0, None
        if cache is not None and getattr(cache, "packed", False):
            # Several requests' tokens in one row: each attends its own cached context (absorbed form).
            w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, H, dn, dv)
            q_nope, q_rope = q.split([dn, dr], dim=-1)
            o = torch.cat([mla_absorbed(q_nope[:, a:b], q_rope[:, a:b], c_i, kr_i, w_kc, w_vc, self.scale,
                                        q_start=p_i) for a, b, c_i, kr_i, p_i in cache.append_packed(c, k_rope)], dim=1)
            return self._gated_out(x, gate, o)
        if cache is not None and hasattr(cache, "append_paged") and (T == 1 or getattr(cache, "paged_prefill", False)) \
                and paged_kernel_used(x.device, self.backends):
            # Serving: attend straight from the page pool (no gathered copy of the cache). Several new tokens per
            # request (a static-buffer prefill step) run as one kernel row per query, each up to its position.
            from k3.ops.mla_decode import mla_decode_absorbed

            w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, H, dn, dv)
            q_nope, q_rope = q.reshape(B * T, H, dn + dr).split([dn, dr], dim=-1)
            # A fixed split count (a CUDA-graph step) keeps the kernel from reading the lengths back.
            o = mla_decode_absorbed(q_nope, q_rope, *cache.append_paged(c, k_rope), w_kc, w_vc, self.scale,
                                    num_splits=getattr(cache, "num_splits", None))
            return self._gated_out(x, gate, o.view(B, T, H, dv))
        if cache is not None:
            c_all, kr_all, past, kv_len = cache.append(c, k_rope)
        if isinstance(past, int) and past == 0 and kv_len is None:
            # Prefill: expand the latent into per-head keys and values.
            kv = self.kv_b_proj(c).view(B, T, H, dn + dv)
            k_nope, v = kv.split([dn, dv], dim=-1)
            k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(B, T, H, dr)], dim=-1)
            if cache is None:  # training and evaluation forwards (compiled flex_attention on GPU)
                mask = batch.flex_block_mask if segment_ids is not None else None  # built once per batch
                o = mla_attention_any(q, k, v, self.scale, segment_ids, return_max_logit=return_max_logit,
                                      backends=self.backends, make_block_mask=mask)
                if return_max_logit:
                    o, top = o
                    top = top.detach()
            else:
                o = mla_attention(q, k, v, self.scale, segment_ids=segment_ids)
        else:
            # Decode / continued prefill: attend against the latent cache directly (absorbed form).
            w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, H, dn, dv)
            q_nope, q_rope = q.split([dn, dr], dim=-1)
            o = mla_absorbed(q_nope, q_rope, c_all, kr_all, w_kc, w_vc, self.scale, q_start=past, kv_len=kv_len)
        out = self._gated_out(x, gate, o)
        return (out, top) if return_max_logit else out

    def _gated_out(self, x: torch.Tensor, gate: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Output gate and projection: o_proj(sigmoid(gate) * o), gate = g_proj x, o of any shape [B, T, ...]."""
        B, T, _ = x.shape
        o = o.reshape(B, T, -1)
        return self.o_proj((torch.sigmoid(gate.float()) * o.float()).to(x.dtype))
