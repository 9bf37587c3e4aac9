"""EAGLE-3 draft layer (report §4.1.4, "Draft Model Fine-Tuning"): the pre-trained MTP layer fed a fusion of
low-, mid- and high-level target features instead of the final hidden state alone.

The target's features at position t are the outputs of two AttnRes blocks (report: the 1st and the 4th) and the
output-site hidden state h_t (the MTP layer's pre-training input), concatenated to [h_a, h_b, h_t] (3D). A
bias-free matrix W_E3 [D, 3D] (`fc`) projects them to the hidden size, and the MTP layer reads the result where it
read h_t:

    g_t = W_E3 [h_a; h_b; h_t],     W_E3 = [0 0 I] at initialization,
    o_t = MTP(g_t, embed(token t + 1))      (enorm / hnorm / eh_proj, one decoder block, its output site)

so at initialization the draft is the pre-trained MTP layer exactly (x I is exact in fp32), and fine-tuning
learns to use the lower features. Drafting is recurrent: only the first step of a proposal has the target's
features (of the committed positions); step j >= 2 takes the draft's own output o of the previous step in place
of g (not through W_E3: o already lives in the hidden space), as the MTP draft does.

Which blocks: `default_feature_blocks` picks (1, 4) when the backbone has at least 4 AttnRes blocks (K3 and
k3-mini), else (1, n - 1) clipped to at least 1 (tiny, 3 blocks: (1, 2)); any pair of block numbers 1 .. n can be
configured, an out-of-range one is refused with the range. The target exposes them through
`K3ForCausalLM.forward(features=...)`.

The embedding, final norm and output head are the target's (shared, not part of the draft).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.common import Linear, set_backends
from k3.model.model import check_feature_blocks, num_attn_res_blocks
from k3.model.mtp import MTPLayer

TTT_STEPS = 7  # the training-time test unroll of EAGLE-3 (report §4.1.4)


def default_feature_blocks(cfg: K3Config) -> tuple[int, int]:
    """(low, mid) AttnRes blocks to fuse: the report's (1, 4) when the backbone has 4 blocks or more, else the
    first and the second-to-last (at least the first)."""
    n = num_attn_res_blocks(cfg)
    return (1, 4) if n >= 4 else (1, max(1, n - 1))


class Eagle3Layer(nn.Module):
    """The draft: `mtp` (an MTPLayer, parameter names as the target's `mtp.0.*`) and `fc` (W_E3, [D, (n + 1) D] for
    n fused blocks). `blocks`: the AttnRes block numbers fused before the final hidden state."""

    def __init__(self, cfg: K3Config, blocks: tuple[int, ...] | None = None):
        super().__init__()
        blocks = tuple(default_feature_blocks(cfg) if blocks is None else blocks)
        check_feature_blocks(cfg, blocks)
        self.config, self.blocks = cfg, blocks
        D = cfg.hidden_size
        self.mtp = MTPLayer(cfg, 0)
        self.fc = Linear((len(blocks) + 1) * D, D, bias=False)
        self.init_fusion()

    @property
    def feature_width(self) -> int:
        return (len(self.blocks) + 1) * self.config.hidden_size

    @torch.no_grad()
    def init_fusion(self) -> "Eagle3Layer":
        """W_E3 = [0 ... 0 I]: the fused input is the final hidden state."""
        D = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -D:].copy_(torch.eye(D, dtype=self.fc.weight.dtype))
        return self

    @classmethod
    def from_target(cls, target, blocks: tuple[int, ...] | None = None) -> "Eagle3Layer":
        """A draft initialized from `target`'s pre-trained MTP layer (copied: the target's stays as it is), W_E3 =
        [0 0 I], on the target's device and dtype."""
        if not len(target.mtp):
            raise ValueError("an EAGLE-3 draft starts from the target's MTP layer (num_nextn_predict_layers >= 1); "
                             "this target has none")
        p = next(target.parameters())
        draft = cls(target.config, blocks).to(device=p.device, dtype=p.dtype)
        draft.mtp.load_state_dict(target.mtp[0].state_dict())
        return set_backends(draft, target.backends)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., (n + 1) D] concatenated target features [h_a, h_b, h_final] -> g [..., D]."""
        return self.fc(features)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, fused: bool, batch: BatchInfo | None = None,
                cache=None, queries: torch.Tensor | None = None) -> torch.Tensor:
        """One drafting step over T positions: `hidden` [B, T, (n + 1) D] target features (`fused` True: the first
        step) or [B, T, D] the draft's previous outputs (`fused` False); next_embeds [B, T, D] the embeddings of the
        tokens that follow. Returns the draft's output-site hidden states [B, T, D] (read by the target's head).
        `queries`: the block's site queries (`MTPLayer.site_queries`), computed already."""
        g = self.fuse(hidden) if fused else hidden
        out, _ = self.mtp(g, next_embeds, batch=batch, cache=cache, queries=queries)
        return out
