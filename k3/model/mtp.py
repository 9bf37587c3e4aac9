"""Multi-token prediction layer (report §4.1.4): one extra block that predicts token t+2 from the
backbone's final hidden state at t and the embedding of token t+1. It mirrors a backbone block
(Gated MLA + LatentMoE with its own AttnRes sites) and shares the embedding, final norm and output head.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.attn_res import residual_stream, site_query
from k3.model.batch import BatchInfo
from k3.model.block import DecoderLayer
from k3.model.common import Linear, RMSNorm
from k3.ops.registry import Backends


class MTPLayer(nn.Module):
    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, cfg: K3Config, depth: int):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = Linear(2 * D, D, bias=False)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers + depth, is_kda=False,
                                  is_moe=cfg.num_experts > 0, res_idx=0)
        if cfg.residual == "attn_res":  # the plain-residual ablation has no output site
            self.output_attn_res_norm = RMSNorm(D, eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        self.eps, self.block_size, self.residual = eps, cfg.attn_res_block_size, cfg.residual

    def site_queries(self) -> torch.Tensor | None:
        """The layer's three AttnRes site queries (the block's mixer and FFN sites, the output site) in one pass,
        [3, D] fp32: the same elementwise products as `site_query` site by site (nine operations), bit for bit. A
        draft computes them once for all its drafting steps (k3.serve.speculative). None for the plain-residual
        ablation or weights of mixed dtypes (each site computes its own)."""
        if self.residual != "attn_res":
            return None
        b = self.block
        norms = (b.self_attention_res_norm, b.mlp_res_norm, self.output_attn_res_norm)
        projs = (b.self_attention_res_proj, b.mlp_res_proj, self.output_attn_res_proj)
        if len({n.weight.dtype for n in norms}) != 1 or len({p.weight.dtype for p in projs}) != 1:
            return None
        return torch.stack([n.weight for n in norms]).float() * torch.stack([p.weight[0] for p in projs]).float()

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: BatchInfo | None = None,
                stats: frozenset[str] = frozenset(), cache=None,
                queries: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """(hidden state [B, T, D], the block's statistics among `stats`, as `DecoderLayer.forward` returns them).
        `batch`: the record of these T positions (`BatchInfo.shifted`). `cache`: the block's MLA decode cache
        (k3.model.cache protocol), when the layer drafts tokens one step at a time (k3.serve.speculative).
        `queries`: `site_queries()` computed already (a forward without gradients; computed here when None)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        stream = residual_stream(self.residual, x, self.block_size, self.eps, backends=self.backends,
                                 fuse=not torch.is_grad_enabled())
        if queries is None and not torch.is_grad_enabled():
            queries = self.site_queries()
        if queries is not None:
            found = self.block(stream, cache, batch=batch, stats=stats, queries=(queries[0], queries[1]))
            return stream.output(queries[2]), found
        found = self.block(stream, cache, batch=batch, stats=stats)
        w = site_query(self.output_attn_res_norm, self.output_attn_res_proj) if self.residual == "attn_res" else None
        return stream.output(w), found
