"""One decoder layer: AttnRes site -> norm -> KDA or Gated MLA; AttnRes site -> norm -> dense MLP or LatentMoE.

Activation checkpointing (``DecoderLayer.activation_checkpointing``, normally set for the whole model with
``K3ForCausalLM.set_activation_checkpointing``): in a training forward (module in training mode, gradients
enabled, no decode cache, one-pass AttnRes) each of the two sublayer applications, "AttnRes mix -> RMSNorm ->
mixer" and "AttnRes mix -> RMSNorm -> FFN", runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
whose inputs are the stream's source tensors (the completed blocks and the running partial sum). Only those are
kept (the stream holds them anyway); everything inside (the fp32 AttnRes softmax intermediates, the norms,
projections, attention / KDA and MoE activations) is recomputed in backward, about one extra forward of compute.
The stream's bookkeeping (closing a block at a block boundary, adding the sublayer outputs to the partial sum)
happens once, outside the recomputed region. The statistics a forward asks for (MLA's per-head max logit,
LatentMoE's routing) are returned, detached, from the checkpointed function: they are the original forward's, and
the recompute in backward, whose outputs are dropped, cannot change them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3.config import K3Config
from k3.model.attn_res import AttnResStream, site_query
from k3.model.batch import BatchInfo
from k3.model.common import RMSNorm, SituMLP
from k3.model.cache import KDACache, MLACache
from k3.model.gated_mla import GatedMLA
from k3.model.kda import KimiDeltaAttention
from k3.model.latent_moe import LatentMoE


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
        # AttnRes sites: gamma and the pseudo-query w (an nn.Linear(D, 1) in the release); none in the plain-residual
        # ablation (config `residual`), whose sites add their sources.
        self.attn_res = cfg.residual == "attn_res"
        if self.attn_res:
            self.self_attention_res_norm = RMSNorm(D, eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if self.is_kda else GatedMLA(cfg, layer_idx)
        if (cfg.is_moe_layer(layer_idx) if is_moe is None else is_moe):
            self.block_sparse_moe = LatentMoE(cfg, layer_idx)
        else:
            self.mlp = SituMLP(D, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        # Recompute both sublayers in backward instead of keeping their activations (see the module docstring).
        self.activation_checkpointing = False

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def site_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (site_query(self.self_attention_res_norm, self.self_attention_res_proj),
                site_query(self.mlp_res_norm, self.mlp_res_proj))

    def new_cache(self):
        return KDACache() if self.is_kda else MLACache()

    def forward(self, stream: AttnResStream, cache=None, batch: BatchInfo | None = None, upcoming=None,
                stats: frozenset[str] = frozenset(), queries: tuple | None = None) -> dict:
        """Advance `stream` by this layer (mixer site, then FFN site). With `activation_checkpointing` on, each
        site is checkpointed in training forwards only: a module in eval mode, a forward without gradients, a
        decode cache or two-phase AttnRes run the plain path (those are inference forms). `queries`: this layer's
        two site queries (`site_queries()`) when the caller computed them already (k3.model.model computes every
        layer's at once in forwards without gradients).

        Returns this layer's statistics among `stats` ({"max_logit": [H]} for a Gated MLA layer, {"routing":
        Routing} for a LatentMoE layer; k3.model.stats), detached."""
        want_max = "max_logit" in stats and not self.is_kda
        want_routing = "routing" in stats and isinstance(self.ffn, LatentMoE)
        ckpt = (self.activation_checkpointing and self.training and torch.is_grad_enabled() and cache is None
                and not stream.two_phase)
        if ckpt:
            out, top = _checkpointed(stream, lambda s: self._attn_site(s, None, batch, want_max=want_max))
            stream.add(out)
            out, routing = _checkpointed(stream, lambda s: self._mlp_site(s, want_routing))
        else:
            w_attn, w_mlp = (None, None) if queries is None else queries
            out, top = self._attn_site(stream, cache, batch, upcoming, want_max, w_attn)
            stream.add(out)
            out, routing = self._mlp_site(stream, want_routing, w_mlp)
        stream.add(out)
        found = {}
        if top is not None:
            found["max_logit"] = top
        if routing is not None:
            found["routing"] = routing
        return found

    def _attn_site(self, stream: AttnResStream, cache=None, batch: BatchInfo | None = None, upcoming=None,
                   want_max: bool = False, w: torch.Tensor | None = None) -> tuple:
        """AttnRes mix -> input norm -> KDA / Gated MLA: (output, the MLA's max logit or None). Closes the
        stream's block at a block boundary. `w`: the site's query, computed here when None."""
        if w is None and self.attn_res:
            w = site_query(self.self_attention_res_norm, self.self_attention_res_proj)
        x = stream.attn_input(self.res_idx, w, upcoming or [], norm=self.input_layernorm)
        if want_max:
            return self.self_attn(x, cache, batch=batch, return_max_logit=True)
        return self.self_attn(x, cache, batch=batch), None

    def _mlp_site(self, stream: AttnResStream, want_routing: bool = False, w: torch.Tensor | None = None) -> tuple:
        """AttnRes mix -> post-attention norm -> dense MLP / LatentMoE: (output, the MoE's routing or None). `w`: the
        site's query, computed here when None."""
        if w is None and self.attn_res:
            w = site_query(self.mlp_res_norm, self.mlp_res_proj)
        x = stream.mlp_input(self.res_idx, w, norm=self.post_attention_layernorm)
        if want_routing:
            return self.ffn(x, return_routing=True)
        return self.ffn(x), None


def _checkpointed(stream: AttnResStream, site) -> tuple:
    """`site(stream)` (one AttnRes site and its sublayer: (output, statistic or None)) under a non-reentrant
    checkpoint whose inputs are the stream's sources.

    The site runs on a private copy of the stream rebuilt from those inputs, so the forward and the recompute in
    backward start from the same state; the state the forward's copy ends in (a block closed at a block boundary)
    is then taken over by `stream`, once. The statistic is detached and comes from this forward: the recompute's
    outputs are dropped."""
    proto = copy.copy(stream)

    def run(*sources):
        view = copy.copy(proto)
        view.blocks, view.partial = list(sources[:-1]), sources[-1]
        return site(view), view

    out, view = checkpoint(run, *stream.blocks, stream.partial, use_reentrant=False)
    vars(stream).update(vars(view))
    return out
