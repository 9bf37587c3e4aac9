"""The decode cache of a whole model: per layer, MLA latent KV (grows) or KDA state + conv tails (fixed)."""

from __future__ import annotations

from k3.model.kda import KDACache
from k3.model.mla import MLACache


class K3Cache:
    def __init__(self, layer_caches: list[KDACache | MLACache]):
        self.layers = layer_caches
        self.seq_len = 0  # tokens processed so far

    def __getitem__(self, i: int):
        return self.layers[i]

    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            tensors = [c.state, *c.conv] if isinstance(c, KDACache) else [c.c, c.k_rope]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total
