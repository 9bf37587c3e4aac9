"""Statistics a forward returns when asked: what load balancing, QK-Clip and the training metrics read.

``model(ids, labels=..., stats=("routing", "max_logit"))`` fills ``CausalLMOutput.stats`` with a
:class:`ForwardStats`. Every tensor in it is detached and belongs to that forward alone: under activation
checkpointing the layers return them from the checkpointed function, so they are those of the original forward,
never of the recompute in backward. A forward that does not ask computes none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3.ops.moe import Routing

__all__ = ["STATS", "ForwardStats", "check_stats"]

# "routing": each LatentMoE layer's routing decision (k3.ops.moe.Routing: top-k weights and expert ids, unbiased
# scores, the (k+1)-th biased score), what Quantile Balancing observes; "max_logit": each Gated MLA layer's
# largest scaled pre-softmax logit per head [H] fp32, what QK-Clip clips with.
STATS = ("routing", "max_logit")


def check_stats(stats: Iterable[str] | str | None) -> frozenset[str]:
    """The statistics named by `stats` (one name or several) as a set; a ValueError names any unknown one."""
    if stats is None:
        return frozenset()
    names = frozenset((stats,) if isinstance(stats, str) else stats)
    unknown = sorted(n for n in names if n not in STATS)
    if unknown:
        raise ValueError(f"stats must name statistics among {STATS}, got {unknown}")
    return names


@dataclass
class ForwardStats:
    """Per-layer statistics of one forward, keyed by the layer's `layer_idx` (backbone layers 0..L-1, the MTP
    block at depth d is L + d). A layer that did not run (an MTP depth longer than the batch) has no entry."""

    asked: frozenset[str] = frozenset()  # the statistics the forward was asked for
    routing: dict[int, Routing] = field(default_factory=dict)  # LatentMoE layers, detached
    max_logit: dict[int, Tensor] = field(default_factory=dict)  # Gated MLA layers, [H] fp32, detached

    def add(self, layer_idx: int, found: dict) -> None:
        """Take one layer's statistics ({name: value}, as `DecoderLayer.forward` returns them)."""
        for name, value in found.items():
            getattr(self, name)[layer_idx] = value

    def expert_loads(self) -> dict[int, Tensor]:
        """Tokens routed to each expert, per MoE layer: [E] int64 counts summing to tokens x top-k, on the
        routing's device (computed on the device: nothing is read back)."""
        out = {}
        for i, r in self.routing.items():
            flat = r.indices.reshape(-1)
            load = torch.zeros(r.scores.shape[-1], dtype=torch.int64, device=flat.device)
            out[i] = load.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
        return out
