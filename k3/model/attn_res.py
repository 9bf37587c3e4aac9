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
from k3.ops.attn_res_norm import attn_res_norm_impl
from k3.ops.registry import REFERENCE, Backends


def site_query(norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """The official site stores gamma [D] and proj [1, D]; only their product enters the score."""
    return norm.weight.float() * proj.weight[0].float()


class AttnResStream:
    """The stream's state through a forward: the completed blocks and the running partial sum.

    `fuse` (a forward without gradients, one-pass mixing): each site whose caller passes the sublayer's input norm
    runs as one kernel when the registry picks a fast implementation of op ``attn_res_norm`` (k3.ops.attn_res_norm:
    the mix and the norm together), and the sublayer outputs added with `add` stay pending until the next site
    reads the partial sum, whose kernel adds them on its way (one pass instead of an add, a mix and a norm). Reading
    `partial` anywhere else does the pending add first, so every reader sees the sum."""

    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float, two_phase: bool = False,
                 backends: Backends | None = None, fuse: bool = False):
        self.blocks: list[torch.Tensor] = []
        self._partial: torch.Tensor | None = embedding
        self._pending: torch.Tensor | None = None  # a sublayer output not yet added to the partial sum (`fuse`)
        self.block_size, self.eps, self.two_phase = block_size, eps, two_phase
        self.backends = backends  # which implementation runs the mix (the model's)
        self._stats = None  # phase-1 statistics for the sites of the current block
        self._site_of: dict = {}
        # the fused site's function, or None: the sites run as the mix (op attn_res) and the caller's norm
        self._fused = None
        if fuse and not two_phase:
            impl = attn_res_norm_impl(embedding, backends)
            self._fused = None if impl.name == REFERENCE else impl.fn

    @property
    def fused(self) -> bool:
        """Whether the sites run as one kernel each with the pending adds (see the class docstring)."""
        return self._fused is not None

    @property
    def partial(self) -> torch.Tensor | None:
        if self._pending is not None:
            self._partial, self._pending = self._partial + self._pending, None
        return self._partial

    @partial.setter
    def partial(self, value: torch.Tensor | None) -> None:
        self._partial, self._pending = value, None

    def _sources(self) -> list[torch.Tensor]:
        """The completed blocks and the partial sum (pending add done), in one dtype."""
        sources = self.blocks + [self.partial]
        dt = sources[0].dtype
        if any(s.dtype != dt for s in sources):  # under autocast the embedding is fp32, layer outputs bf16
            for s in sources[1:]:
                dt = torch.promote_types(dt, s.dtype)
            sources = [s.to(dt) for s in sources]
        return sources

    def _mix(self, key, w: torch.Tensor) -> torch.Tensor:
        if self.two_phase and key in self._site_of:
            return attn_res_merge(self._stats, self._site_of[key], self.partial, w, self.eps)
        return attn_res_any(self._sources(), w, self.eps, backends=self.backends)

    def _site(self, key, w: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """The site's mix, through `norm` when one is given: as one fused kernel with the pending add when the stream
        fuses and the sources share a dtype, else the mix then the norm."""
        if self._fused is not None:
            sources = self.blocks + [self._partial]
            if all(s.dtype == sources[0].dtype for s in sources) and \
                    (self._pending is None or self._pending.dtype == sources[0].dtype):
                y, self._partial = self._fused(sources, w, self.eps, None if norm is None else norm.weight,
                                               self.eps if norm is None else norm.eps, self._pending)
                self._pending = None
                return y
        h = self._mix(key, w)
        return h if norm is None else norm(h)

    def attn_input(self, layer_idx: int, w: torch.Tensor, upcoming: list[tuple[object, torch.Tensor]],
                   norm: RMSNorm | None = None):
        """Input of layer `layer_idx`'s mixer, through the mixer's input `norm` when given. `upcoming` lists (key,
        query) of the sites of the block that starts here (only used at a block boundary, for the two-phase batched
        pass)."""
        if not self.blocks:
            h = self.partial
            h = h if norm is None else norm(h)
        else:
            h = self._site(("attn", layer_idx), w, norm)
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
        """Add a sublayer's output to the partial sum (kept pending for the next site's kernel when fusing)."""
        if self._partial is None:
            self.partial = out
        elif self._fused is not None:
            if self._pending is not None:  # two adds without a site between them (not in a decoder layer)
                self._partial = self._partial + self._pending
            self._pending = out
        else:
            self._partial = self._partial + out

    def mlp_input(self, layer_idx: int, w: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """Input of layer `layer_idx`'s FFN, through the FFN's input `norm` when given."""
        return self._site(("mlp", layer_idx), w, norm)

    def output(self, w: torch.Tensor) -> torch.Tensor:
        return self._site(("out", None), w, None)


class PlainResidualStream(AttnResStream):
    """The plain-residual ablation: a site's input is the sum of its sources (the site queries are ignored and
    none exist), added in fp32 and returned in the sources' dtype. No two-phase form (nothing to batch)."""

    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float, two_phase: bool = False,
                 backends: Backends | None = None, fuse: bool = False):
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
                    backends: Backends | None = None, fuse: bool = False) -> AttnResStream:
    """The stream of the config's `residual`: Block AttnRes (K3), or plain residuals (the ablation, never fused).
    `fuse`: the sites may run as fused kernels (forwards without gradients; AttnResStream)."""
    cls = PlainResidualStream if residual == "plain" else AttnResStream
    return cls(embedding, block_size, eps, two_phase=two_phase, backends=backends, fuse=fuse)
