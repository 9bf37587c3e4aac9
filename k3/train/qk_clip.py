"""QK-Clip (Kimi K2's weight clipping, applied per Gated MLA head), report §3.3.

A forward run with ``stats=("max_logit",)`` returns, in ``out.stats.max_logit``, each Gated MLA layer's [H]
largest causal pre-softmax logit per head (softmax scale included). After the optimizer step, a head whose
maximum m_h exceeds tau is rescaled with gamma = tau / m_h so that its logits shrink by exactly gamma:

* query "nope" rows of q_b_proj   * sqrt(gamma)   (rows h*(dn+dr) : h*(dn+dr)+dn)
* query extra ("rope") rows        * gamma         (rows h*(dn+dr)+dn : (h+1)*(dn+dr))
* key "nope" rows of kv_b_proj    * sqrt(gamma)   (rows h*(dn+dv) : h*(dn+dv)+dn)

The extra key dims (kv_a_proj_with_mqa rows kv_lora_rank:) are shared by all heads and stay untouched,
which is why the query side of those dims takes the whole gamma; the value rows are untouched too.
Logit_h = scale * (q_nope . k_nope + q_extra . k_extra) therefore becomes gamma * logit_h.

Gradient accumulation: a :class:`MaxLogitTracker` folds the statistics of every training forward it is shown
(the step's micro-batches) into a running max, so clipping sees the whole step's batch, not only the last
micro-batch. Its owner decides what it sees: the trainer shows it its training forwards and never an evaluation.
Under activation checkpointing the statistics are the original forward's (k3.model.block), so recomputation
changes nothing. Under context parallelism each rank's maxima are those of its segment's queries over the keys they
see (k3.parallel.context_parallel.mla_context_parallel), so the MAX over all ranks is the whole row's.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from k3.model.gated_mla import GatedMLA
from k3.model.stats import ForwardStats

__all__ = ["MaxLogitTracker", "qk_clip_", "apply_qk_clip_", "mla_layers"]


def mla_layers(model: nn.Module) -> list[GatedMLA]:
    """Every Gated MLA layer of the model (backbone and MTP), in module order."""
    return [m for m in model.modules() if isinstance(m, GatedMLA)]


class MaxLogitTracker:
    """The running per-head max logit of each Gated MLA layer of `model` over the forwards observed since the
    last :meth:`consume`: one optimizer step's micro-batches."""

    def __init__(self, model: nn.Module):
        self.layers = [(m.layer_idx, m.num_heads) for m in mla_layers(model)]
        self._device = next((m.q_b_proj.weight.device for m in mla_layers(model)), torch.device("cpu"))
        self._running: dict[int, torch.Tensor] = {}  # layer_idx -> [H] fp32 running max

    def observe(self, stats: ForwardStats | None) -> None:
        """Fold one forward's `stats.max_logit` into the running maxima (on the device: nothing is read back)."""
        if stats is None or "max_logit" not in stats.asked:
            raise ValueError("observe needs the statistics of a forward run with stats=('max_logit',) "
                             "(its output's .stats)")
        for i, cur in stats.max_logit.items():
            run = self._running.get(i)
            # fmax: a NaN record (a diverged micro-batch) does not hide the other micro-batches' maxima.
            self._running[i] = cur.detach().float().clone() if run is None else torch.fmax(run, cur.float())

    def discard(self) -> None:
        """Forget what was observed since the last consume (a step that is retried)."""
        self._running = {}

    @torch.no_grad()
    def consume(self, process_group=None) -> list[torch.Tensor | None]:
        """Each Gated MLA layer's per-head max logit [H] (fp32, on the device) over the forwards observed since
        the last call, in `mla_layers(model)` order, or None for a layer that saw nothing; all-reduced (MAX) over
        `process_group` when torch.distributed is initialized. Nothing is read back to the host."""
        maxima = [self._running.get(i) for i, _ in self.layers]
        self._running = {}
        if dist.is_available() and dist.is_initialized() and self.layers:
            # Every rank must contribute the same shapes: unrecorded layers send -inf.
            dev = next((t.device for t in maxima if t is not None), self._device)
            flat = torch.cat([t.to(dev) if t is not None else torch.full((h,), -math.inf, device=dev)
                              for (_, h), t in zip(self.layers, maxima)])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=process_group)
            parts = flat.split([h for _, h in self.layers])
            maxima = [None if torch.isneginf(p).all() else p for p in parts]
        if self.layers and all(t is None for t in maxima):
            warnings.warn("qk_clip_: no Gated MLA layer recorded a max logit since the last call; observe the "
                          "statistics of forwards run with stats=('max_logit',)", stacklevel=3)
        return [None if t is None else t.float() for t in maxima]


@torch.no_grad()
def qk_clip_(model: nn.Module, max_logits: MaxLogitTracker, tau: float = 100.0, process_group=None) -> dict:
    """Clip the Gated MLA heads whose max logit, as `max_logits` observed it, exceeds `tau` (in place, after
    optimizer.step()).

    Returns {"max_logit": float over all recorded heads and layers (-inf if none was recorded),
    "clipped_heads": int, "per_layer": {layer_idx: [H] fp32 tensor of the maxima that were used}}.
    The maxima are consumed: the next call only sees forwards observed after this one.

    When torch.distributed is initialized the maxima are all-reduced (MAX) over `process_group` (default:
    the world), so data-parallel replicas clip identically. Non-finite maxima are reported but not clipped
    (scaling by tau/inf would zero the head; a NaN/inf logit is the trainer's divergence check to handle).

    The same as ``apply_qk_clip_(model, max_logits.consume(process_group), tau)``; a training loop that reads
    other values back from the device anyway can consume the maxima before the optimizer step, read them with
    those values, and apply the clip after the step without waiting for the device again.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    return apply_qk_clip_(model, max_logits.consume(process_group), tau)


@torch.no_grad()
def apply_qk_clip_(model: nn.Module, maxima: list[torch.Tensor | None], tau: float = 100.0) -> dict:
    """Clip with the maxima of `MaxLogitTracker.consume` (one per Gated MLA layer, on any device); returns what
    `qk_clip_` returns. The maxima are read to the host in one transfer (none when they are there already);
    the weights of the heads over `tau` are then scaled on their device without further reads."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    layers = mla_layers(model)
    if len(maxima) != len(layers):
        raise ValueError(f"maxima must hold one entry per Gated MLA layer ({len(layers)}), got {len(maxima)}")
    present = [t.reshape(-1).float() for t in maxima if t is not None]
    host = torch.cat([t.to(present[0].device) for t in present]).cpu() if present else torch.empty(0)
    per_layer: dict[int, torch.Tensor] = {}
    overall, clipped, off = -math.inf, 0, 0
    for m, mx in zip(layers, maxima):
        if mx is None:
            continue
        mx = host[off:off + mx.numel()]
        off += mx.numel()
        per_layer[m.layer_idx] = mx
        if mx.numel():
            overall = max(overall, float(mx.max()))
        over = torch.isfinite(mx) & (mx > tau)
        heads = torch.nonzero(over).flatten()
        if heads.numel() == 0:
            continue
        clipped += heads.numel()
        _clip_heads(m, heads, tau / mx[heads].double())
    return {"max_logit": overall, "clipped_heads": clipped, "per_layer": per_layer}


def _clip_heads(m: GatedMLA, heads: torch.Tensor, gamma: torch.Tensor) -> None:
    """Scale the query/key rows of `heads` of one layer so their logits shrink by `gamma` [n] (fp64)."""
    H, dn, dr, dv = m.num_heads, m.dn, m.dr, m.dv
    wq = m.q_b_proj.weight  # [H*(dn+dr), r_q]
    wkv = m.kv_b_proj.weight  # [H*(dn+dv), r_kv]
    heads, g = heads.to(wq.device), gamma.to(wq.device)[:, None, None]
    q = wq.view(H, dn + dr, wq.shape[1])  # views: the writes land in the parameters
    kv = wkv.view(H, dn + dv, wkv.shape[1])
    q[heads, :dn] = (q[heads, :dn].double() * g.sqrt()).to(q.dtype)
    q[heads, dn:] = (q[heads, dn:].double() * g).to(q.dtype)
    kv[heads, :dn] = (kv[heads, :dn].double() * g.sqrt()).to(kv.dtype)
