"""One decoder layer: AttnRes site -> norm -> KDA or Gated MLA; AttnRes site -> norm -> dense MLP or LatentMoE."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.attn_res import AttnResStream, site_query
from k3.model.common import RMSNorm, SituMLP
from k3.model.kda import KDACache, KimiDeltaAttention
from k3.model.latent_moe import LatentMoE
from k3.model.mla import GatedMLA, MLACache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int, is_kda: bool | None = None, is_moe: bool | None = None,
                 res_idx: int | None = None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        # Position in the AttnRes stream (the MTP block is a one-layer stream of its own).
        self.res_idx = layer_idx if res_idx is None else res_idx
        self.is_kda = cfg.is_kda_layer(layer_idx) if is_kda is None else is_kda
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        # AttnRes sites: gamma and the pseudo-query w (an nn.Linear(D, 1) in the release).
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if self.is_kda else GatedMLA(cfg, layer_idx)
        if (cfg.is_moe_layer(layer_idx) if is_moe is None else is_moe):
            self.block_sparse_moe = LatentMoE(cfg, layer_idx)
        else:
            self.mlp = SituMLP(D, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def site_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (site_query(self.self_attention_res_norm, self.self_attention_res_proj),
                site_query(self.mlp_res_norm, self.mlp_res_proj))

    def new_cache(self):
        return KDACache() if self.is_kda else MLACache()

    def forward(self, stream: AttnResStream, cache=None, segment_ids=None, cu_seqlens=None,
                upcoming=None) -> None:
        w_attn, w_mlp = self.site_queries()
        h = stream.attn_input(self.res_idx, w_attn, upcoming or [])
        x = self.input_layernorm(h)
        if self.is_kda:
            if cu_seqlens is not None:  # packed documents: one row of sequences, state reset at each start
                B, T, D = x.shape
                a = self.self_attn(x.reshape(1, B * T, D), cache, cu_seqlens=cu_seqlens).view(B, T, D)
            else:
                a = self.self_attn(x, cache)
        else:
            a = self.self_attn(x, cache, segment_ids=segment_ids)
        stream.add(a)
        h = stream.mlp_input(self.res_idx, w_mlp)
        stream.add(self.ffn(self.post_attention_layernorm(h)))
