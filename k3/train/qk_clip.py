"""QK-Clip (Kimi K2's weight clipping, applied per Gated MLA head), report §3.3.

During the forward, every `GatedMLA` with ``record_max_logit = True`` stores ``last_max_logit`` [H]: each
head's largest causal pre-softmax logit (softmax scale included). After the optimizer step, a head whose
maximum m_h exceeds tau is rescaled with gamma = tau / m_h so that its logits shrink by exactly gamma:

* query "nope" rows of q_b_proj   * sqrt(gamma)   (rows h*(dn+dr) : h*(dn+dr)+dn)
* query extra ("rope") rows        * gamma         (rows h*(dn+dr)+dn : (h+1)*(dn+dr))
* key "nope" rows of kv_b_proj    * sqrt(gamma)   (rows h*(dn+dv) : h*(dn+dv)+dn)

The extra key dims (kv_a_proj_with_mqa rows kv_lora_rank:) are shared by all heads and stay untouched,
which is why the query side of those dims takes the whole gamma; the value rows are untouched too.
Logit_h = scale * (q_nope . k_nope + q_extra . k_extra) therefore becomes gamma * logit_h.

Gradient accumulation: `enable_max_logit_recording` also hooks each layer so that the maxima of all the
training forwards (gradients enabled) since the last `qk_clip_` are combined (a running max): clipping sees
the whole step's batch, not only the last micro-batch. The latest record is always included, whether or not
its forward ran with gradients. Recomputation (activation checkpointing) is harmless: taking a max again
changes nothing, and each record is consumed at most once.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn

from k3.model.mla import GatedMLA

__all__ = ["enable_max_logit_recording", "qk_clip_", "consume_max_logits", "apply_qk_clip_", "mla_layers"]

_RUNNING = "_qk_clip_running_max"  # running max [H] since the last qk_clip_ (set by the forward hook)
_SEEN = "_qk_clip_seen"  # the last `last_max_logit` tensor already folded in (records are consumed once)


def mla_layers(model: nn.Module) -> list[GatedMLA]:
    """Every Gated MLA layer of the model (backbone and MTP), in module order."""
    return [m for m in model.modules() if isinstance(m, GatedMLA)]


def _fold_record(m: GatedMLA) -> None:
    """Fold a fresh `last_max_logit` into the running max (each recorded tensor only once)."""
    cur = m.last_max_logit
    if cur is None or cur is getattr(m, _SEEN, None):
        return
    setattr(m, _SEEN, cur)
    run = getattr(m, _RUNNING, None)
    # fmax: a NaN record (a diverged micro-batch) does not hide the other micro-batches' maxima.
    setattr(m, _RUNNING, cur.detach().float().clone() if run is None else torch.fmax(run, cur.float()))


def _record_hook(m: GatedMLA, args, output) -> None:
    # Only training forwards (gradients on) accumulate; an evaluation under no_grad between two steps must
    # not steer the clipping of the weights being trained.
    if m.record_max_logit and torch.is_grad_enabled():
        _fold_record(m)


def enable_max_logit_recording(model: nn.Module, on: bool = True) -> None:
    """Turn per-head max-logit recording on (or off) in every Gated MLA layer of `model`.

    Turning it off also removes the accumulation hook and drops any recorded maxima."""
    for m in mla_layers(model):
        m.record_max_logit = on
        hooked = any(h is _record_hook for h in m._forward_hooks.values())
        if on and not hooked:
            m.register_forward_hook(_record_hook)
        elif not on:
            for key in [k for k, h in m._forward_hooks.items() if h is _record_hook]:
                del m._forward_hooks[key]
            m.last_max_logit = None
            setattr(m, _RUNNING, None)
            setattr(m, _SEEN, None)


def _consume(m: GatedMLA) -> torch.Tensor | None:
    """The layer's per-head max logit over every forward since the last call (None if nothing recorded)."""
    _fold_record(m)  # a record made without the hook (flag set by hand) still counts
    run = getattr(m, _RUNNING, None)
    setattr(m, _RUNNING, None)
    return run


@torch.no_grad()
def qk_clip_(model: nn.Module, tau: float = 100.0, process_group=None) -> dict:
    """Clip the Gated MLA heads whose recorded max logit exceeds `tau` (in place, after optimizer.step()).

    Returns {"max_logit": float over all recorded heads and layers (-inf if none was recorded),
    "clipped_heads": int, "per_layer": {layer_idx: [H] fp32 tensor of the maxima that were used}}.
    The maxima are consumed: the next call only sees forwards made after this one.

    When torch.distributed is initialized the maxima are all-reduced (MAX) over `process_group` (default:
    the world), so data-parallel replicas clip identically. Non-finite maxima are reported but not clipped
    (scaling by tau/inf would zero the head; a NaN/inf logit is the trainer's divergence check to handle).

    The same as ``apply_qk_clip_(model, consume_max_logits(model, process_group), tau)``; a training loop that
    reads other values back from the device anyway can consume the maxima before the optimizer step, read them
    with those values, and apply the clip after the step without waiting for the device again.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    return apply_qk_clip_(model, consume_max_logits(model, process_group), tau)


@torch.no_grad()
def consume_max_logits(model: nn.Module, process_group=None) -> list[torch.Tensor | None]:
    """Each Gated MLA layer's per-head max logit [H] (fp32, on the device) over the forwards since the last
    call, or None for a layer that recorded nothing; all-reduced (MAX) when torch.distributed is initialized.
    Nothing is read back to the host."""
    layers = mla_layers(model)
    maxima = [_consume(m) for m in layers]
    if dist.is_available() and dist.is_initialized() and layers:
        # Every rank must contribute the same shapes: unrecorded layers send -inf.
        dev = next((t.device for t in maxima if t is not None), layers[0].q_b_proj.weight.device)
        flat = torch.cat([t.to(dev) if t is not None else torch.full((m.num_heads,), -math.inf, device=dev)
                          for m, t in zip(layers, maxima)])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=process_group)
        parts = flat.split([m.num_heads for m in layers])
        maxima = [None if torch.isneginf(p).all() else p for p in parts]
    if layers and all(t is None for t in maxima):
        warnings.warn("qk_clip_: no Gated MLA layer recorded a max logit since the last call; call "
                      "enable_max_logit_recording(model) before the forward", stacklevel=3)
    return [None if t is None else t.float() for t in maxima]


@torch.no_grad()
def apply_qk_clip_(model: nn.Module, maxima: list[torch.Tensor | None], tau: float = 100.0) -> dict:
    """Clip with the maxima of `consume_max_logits` (one per Gated MLA layer, on any device); returns what
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
