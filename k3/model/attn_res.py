"""Block Attention Residuals over the layer stack (report §2.2, checkpoint-layout quirk 8).

Sources are the token embedding, the completed block sums and the running partial sum of the current
block. At layer l:
  attention site: mix(completed + [partial])   (layer 0 has no completed block: its input is the embedding)
  if l % S == 0:  the partial is closed into a completed block, and a new partial starts with the mixer output
  FFN site:       mix(completed + [partial incl. this layer's mixer output])
and the output site mixes completed + [final partial]. `AttnResStream` keeps that state.

`two_phase=True` computes the same result the inference way: once per block, one batched pass of every
site's query over the completed blocks (which stay fixed for the whole block), then an online-softmax merge
with the partial sum at each site.

`PlainResidualStream` is the plain-residual ablation (config `residual="plain"`, not K3): every site's input is
the sum of all sources, h = embedding + every earlier sublayer output, i.e. h = h + sublayer(norm(h)). It keeps
the same block bookkeeping, so the block outputs (`features=`) and activation checkpointing work unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.model.common import RMSNorm
from k3.ops.attn_res import attn_res_any, attn_res_inter, attn_res_merge
from k3.ops.registry import Backends


def site_query(norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """The official site stores gamma [D] and proj [1, D]; only their product enters the score."""
    return norm.weight.float() * proj.weight[0].float()


class AttnResStream:
    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float, two_phase: bool = False,
                 backends: Backends | None = None):
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding
        self.block_size, self.eps, self.two_phase = block_size, eps, two_phase
        self.backends = backends  # which implementation runs the mix (the model's)
        self._stats = None  # phase-1 statistics for the sites of the current block
        self._site_of: dict = {}

    def _mix(self, key, w: torch.Tensor) -> torch.Tensor:
        if self.two_phase and key in self._site_of:
            return attn_res_merge(self._stats, self._site_of[key], self.partial, w, self.eps)
        sources = self.blocks + [self.partial]
        dt = sources[0].dtype
        if any(s.dtype != dt for s in sources):  # under autocast the embedding is fp32, layer outputs bf16
            for s in sources[1:]:
                dt = torch.promote_types(dt, s.dtype)
            sources = [s.to(dt) for s in sources]
        return attn_res_any(sources, w, self.eps, backends=self.backends)

    def attn_input(self, layer_idx: int, w: torch.Tensor, upcoming: list[tuple[object, torch.Tensor]]):
        """Input of layer `layer_idx`'s mixer. `upcoming` lists (key, query) of the sites of the block
        that starts here (only used at a block boundary, for the two-phase batched pass)."""
        h = self.partial if not self.blocks else self._mix(("attn", layer_idx), w)
        if layer_idx % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
            if self.two_phase and upcoming:
                ws = torch.stack([q for _, q in upcoming])
                dt = self.blocks[0].dtype
                for b in self.blocks[1:]:
                    dt = torch.promote_types(dt, b.dtype)
                self._stats = attn_res_inter(torch.stack([b.to(dt) for b in self.blocks]), ws, self.eps)
                self._site_of = {key: i for i, (key, _) in enumerate(upcoming)}
        return h

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def mlp_input(self, layer_idx: int, w: torch.Tensor) -> torch.Tensor:
        return self._mix(("mlp", layer_idx), w)

    def output(self, w: torch.Tensor) -> torch.Tensor:
        return self._mix(("out", None), w)


class PlainResidualStream(AttnResStream):
    """The plain-residual ablation: a site's input is the sum of its sources (the site queries are ignored and
    none exist), added in fp32 and returned in the sources' dtype. No two-phase form (nothing to batch)."""

    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float, two_phase: bool = False,
                 backends: Backends | None = None):
        super().__init__(embedding, block_size, eps, two_phase=False, backends=backends)

    def _mix(self, key, w) -> torch.Tensor:
        sources = self.blocks + [self.partial]
        dt = sources[0].dtype
        for s in sources[1:]:
            dt = torch.promote_types(dt, s.dtype)
        total = sources[0].float()
        for s in sources[1:]:
            total = total + s.float()
        return total.to(dt)


def residual_stream(residual: str, embedding: torch.Tensor, block_size: int, eps: float, two_phase: bool = False,
                    backends: Backends | None = None) -> AttnResStream:
    """The stream of the config's `residual`: Block AttnRes (K3), or plain residuals (the ablation)."""
    cls = PlainResidualStream if residual == "plain" else AttnResStream
    return cls(embedding, block_size, eps, two_phase=two_phase, backends=backends)
