"""Gated MLA attention core without positional encoding (report §2.1.2).

K3's MLA layers use no RoPE ("NoPE"): the KDA layers carry position information.
Per head the query/key dim is ``Dn + Dr`` (128 + 64 = 192): ``Dn`` "nope" dims
decompressed per head from the latent, and ``Dr`` extra key dims projected directly
from the hidden state and shared by all heads. Nothing is rotated; the extra dims
keep the checkpoint layout of MLA (the ``*_rope`` names) but are plain features.
The output gate and projections live in the model; this module is the attention core.

Two equivalent forms:

* ``mla_attention`` - the explicit form (training, prefill): keys and values are
  decompressed to [B, T, H, D] and fed to scaled-dot-product attention.
* ``mla_absorbed`` - the decode form: ``w_kc`` is folded into the query and ``w_vc``
  into the output, so attention runs directly against the cached latent ``c`` [B, L, R]
  and the cache never has to be expanded per head.

The training forward reaches attention through op ``mla`` (``mla_attention_any``), whose reference is
``mla_attention`` with ``max_logit`` (QK-Clip's signal) and whose fast implementation is flex_attention
(k3.ops.mla_flex: it imports nothing from here, and its public names can be imported from here too).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import mla_flex
from k3.ops.mla_flex import causal_block_mask, compiled_flex, flex_available, flex_kernel_options, mla_attention_flex
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["mla_attention", "mla_attention_any", "mla_absorbed", "max_logit", "split_kv_b",
           # the flex_attention implementation (k3.ops.mla_flex), for callers that import it from here
           "causal_block_mask", "compiled_flex", "flex_available", "flex_kernel_options", "mla_attention_flex"]


def _as_positions(name: str, value, batch: int, device: torch.device) -> Tensor:
    """An int or a LongTensor [B] -> LongTensor [B] on ``device``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or an integer tensor of shape [{batch}], got a bool")
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long, device=device)
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.ndim == 0:
            return value.to(device=device, dtype=torch.long).expand(batch)
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape [{batch}] (one per batch row), got {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.long)
    raise ValueError(f"{name} must be an int or an integer tensor of shape [{batch}], got {type(value).__name__}")


ABSORBED_SCORE_BYTES = 2**29  # mla_absorbed: the most fp32 attention scores held at once (512 MB)


def _host_positions(name: str, value, batch: int) -> list[int] | None:
    """An int or a list of B ints -> a list of B ints (checked on the host); None for a tensor."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or an integer tensor of shape [{batch}], got a bool")
    if isinstance(value, int):
        return [value] * batch
    if isinstance(value, (list, tuple)):
        if len(value) != batch or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{name} must hold {batch} ints (one per batch row), got {value!r}")
        return list(value)
    return None


def _checked_positions(name: str, value, batch: int, device, lo: int, hi: int | None, rule: str) -> Tensor:
    """An int, list of B ints or LongTensor [B] -> LongTensor [B] on `device`, every entry in [lo, hi] (hi None:
    unbounded), else a ValueError "<name> must be <rule>". Host values are checked on the host: checking a device
    tensor reads it back (a sync)."""
    host = _host_positions(name, value, batch)
    if host is not None:
        if any(v < lo or (hi is not None and v > hi) for v in host):
            raise ValueError(f"{name} must be {rule}, got {host}")
        return torch.tensor(host, dtype=torch.long, device=device)
    t = _as_positions(name, value, batch, device)
    bad = t < lo if hi is None else (t < lo) | (t > hi)
    if bool(bad.any()):
        raise ValueError(f"{name} must be {rule}, got {t.tolist()}")
    return t


def mla_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    q_start: int | Tensor = 0,
    segment_ids: Tensor | None = None,
) -> Tensor:
    """Causal softmax attention, explicit form (training and prefill).

    Args:
        q: [B, Tq, H, Dqk] queries; query i sits at absolute position ``q_start + i``.
        k: [B, Tk, H, Dqk] keys; key j sits at position j.
        v: [B, Tk, H, Dv] values.
        scale: softmax scale (K3: ``192 ** -0.5``).
        q_start: int, or LongTensor [B] (per batch row), >= 0. With ``q_start > 0`` the
            queries are the tail of the key sequence (chunked prefill against a cache).
        segment_ids: optional integer [B, Tk] document id of every key position; query i
            only sees keys with ``segment_ids[:, q_start + i]`` (packed documents).
            Requires ``q_start + Tq <= Tk``.

    Returns:
        o: [B, Tq, H, Dv] in ``q.dtype``. Key j is visible to query i iff
        ``j <= q_start + i`` (and the segments match).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k, v must be 4-D [B, T, H, D], got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, Tq, H, Dqk = q.shape
    Tk = k.shape[1]
    if k.shape != (B, Tk, H, Dqk):
        raise ValueError(f"k must have shape [B={B}, Tk, H={H}, Dqk={Dqk}] to match q, got {tuple(k.shape)}")
    if v.shape[:3] != (B, Tk, H):
        raise ValueError(f"v must have shape [B={B}, Tk={Tk}, H={H}, Dv] to match k, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")

    # Fast path: plain causal self-attention over the whole sequence.
    if isinstance(q_start, int) and not isinstance(q_start, bool) and q_start == 0 and Tq == Tk and segment_ids is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
        return o.transpose(1, 2)

    # Every query must see at least key 0, or its softmax row would be empty (NaN).
    start = _checked_positions("q_start", q_start, B, q.device, 0, None, ">= 0")

    q_pos = start[:, None] + torch.arange(Tq, device=q.device)  # [B, Tq] absolute positions
    k_pos = torch.arange(Tk, device=q.device)  # [Tk]
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Tq, Tk]

    if segment_ids is not None:
        if segment_ids.shape != (B, Tk):
            raise ValueError(f"segment_ids must have shape [B={B}, Tk={Tk}], got {tuple(segment_ids.shape)}")
        if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex:
            raise ValueError(f"segment_ids must be an integer tensor, got dtype {segment_ids.dtype}")
        if Tq > 0 and bool((q_pos[:, -1] >= Tk).any()):
            raise ValueError(
                f"with segment_ids, q_start + Tq must be <= Tk={Tk} (each query's own key must exist), "
                f"got q_start {start.tolist()} and Tq={Tq}"
            )
        # Packed documents must not attend across document boundaries.
        seg = segment_ids.to(q.device)
        q_seg = seg.gather(1, q_pos)  # [B, Tq]
        visible = visible & (q_seg[:, :, None] == seg[:, None, :])

    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],  # [B, 1, Tq, Tk], broadcast over heads; True = attend
        scale=scale,
    )
    return o.transpose(1, 2)


def mla_absorbed(
    q_nope: Tensor,
    q_rope: Tensor,
    c: Tensor,
    k_rope: Tensor,
    w_kc: Tensor,
    w_vc: Tensor,
    scale: float,
    q_start: int | Tensor | None = None,
    kv_len: int | Tensor | None = None,
    check: bool = True,
) -> Tensor:
    """MLA against the latent cache with the up-projections absorbed (decode form).

    Mathematically equal to expanding ``k_nope_h = c @ w_kc[h].T``, ``v_h = c @ w_vc[h].T``,
    ``k_h = [k_nope_h, k_rope]`` and calling ``mla_attention``; but the per-head keys and
    values are never materialized: the query is moved into latent space instead
    (``q_nope_h @ w_kc[h]``, [R]) and the attention output is read out of it at the end.

    Args:
        q_nope: [B, Tq, H, Dn] per-head query dims that meet the latent.
        q_rope: [B, Tq, H, Dr] query dims that meet the shared key dims ``k_rope``.
        c: [B, L, R] cached normalized latent (K3: R = 512).
        k_rope: [B, L, Dr] cached shared key dims (one vector for all heads).
        w_kc: [H, Dn, R] latent -> per-head key (see ``split_kv_b``).
        w_vc: [H, Dv, R] latent -> per-head value.
        scale: softmax scale (K3: ``(Dn + Dr) ** -0.5``).
        q_start: int, list of B ints or LongTensor [B]; query i sits at position ``q_start + i``.
            Default ``kv_len - Tq``: the queries are the last Tq cached positions.
        kv_len: int, list of B ints or LongTensor [B] in [1, L]: valid cache length per batch row;
            positions >= kv_len are padding and ignored whatever they contain. Default L.
        check: verify that tensor ``kv_len`` and ``q_start`` lie in range, which reads them back from the device.
            False (a caller whose lengths are valid by construction, e.g. inside a CUDA graph) skips that read.

    Returns:
        o: [B, Tq, H, Dv] in ``q_nope.dtype`` (scores and softmax in fp32).
    """
    if q_nope.ndim != 4:
        raise ValueError(f"q_nope must be 4-D [B, Tq, H, Dn], got {tuple(q_nope.shape)}")
    B, Tq, H, Dn = q_nope.shape
    if c.ndim != 3 or c.shape[0] != B:
        raise ValueError(f"c must have shape [B={B}, L, R], got {tuple(c.shape)}")
    _, L, R = c.shape
    if q_rope.ndim != 4 or q_rope.shape[:3] != (B, Tq, H):
        raise ValueError(f"q_rope must have shape [B={B}, Tq={Tq}, H={H}, Dr], got {tuple(q_rope.shape)}")
    Dr = q_rope.shape[3]
    if k_rope.shape != (B, L, Dr):
        raise ValueError(f"k_rope must have shape [B={B}, L={L}, Dr={Dr}], got {tuple(k_rope.shape)}")
    if w_kc.shape != (H, Dn, R):
        raise ValueError(f"w_kc must have shape [H={H}, Dn={Dn}, R={R}], got {tuple(w_kc.shape)}")
    if w_vc.ndim != 3 or w_vc.shape[0] != H or w_vc.shape[2] != R:
        raise ValueError(f"w_vc must have shape [H={H}, Dv, R={R}], got {tuple(w_vc.shape)}")
    named = {"q_nope": q_nope, "q_rope": q_rope, "c": c, "k_rope": k_rope, "w_kc": w_kc, "w_vc": w_vc}
    for name, t in named.items():
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")

    device = q_nope.device
    if not check and isinstance(kv_len, Tensor) and isinstance(q_start, Tensor):
        lengths, start = _as_positions("kv_len", kv_len, B, device), _as_positions("q_start", q_start, B, device)
    else:
        lengths = _checked_positions("kv_len", L if kv_len is None else kv_len, B, device, 1, L, f"in [1, L={L}]")
        if q_start is None:  # the queries are the last Tq cached positions
            host_len = _host_positions("kv_len", L if kv_len is None else kv_len, B)
            q_start = [n - Tq for n in host_len] if host_len is not None else lengths - Tq
        # q_start >= 0 keeps key 0 visible to every query, so no softmax row is empty.
        start = _checked_positions("q_start", q_start, B, device, 0, None,
                                   f">= 0 (default kv_len - Tq needs kv_len >= Tq={Tq})")

    k_pos = torch.arange(L, device=device)
    in_cache = k_pos[None, :] < lengths[:, None]  # [B, L]
    q_pos = start[:, None] + torch.arange(Tq, device=device)  # [B, Tq]

    # Padding slots may hold anything (stale or uninitialized memory, even inf/NaN);
    # zero them so 0-probability * garbage cannot poison the sums.
    c32 = c.float().masked_fill(~in_cache[:, :, None], 0.0)
    k_rope32 = k_rope.float().masked_fill(~in_cache[:, :, None], 0.0)

    # Absorb w_kc into the query: (q_nope_h @ w_kc[h]) . c_j == q_nope_h . (c_j @ w_kc[h].T).
    q_lat = torch.einsum("bthn,hnr->bthr", q_nope.float(), w_kc.float())  # [B, Tq, H, R]
    q_rope32 = q_rope.float()
    # Queries in blocks whose fp32 scores [B, H, tq, L] stay within ABSORBED_SCORE_BYTES (a 4K-token prefill chunk
    # against a 128K context would otherwise hold 17 GB of scores per layer); each softmax row is independent.
    tq = max(1, ABSORBED_SCORE_BYTES // max(1, B * H * L * 4))
    o_lat = []
    for a in range(0, Tq, tq):
        b = min(Tq, a + tq)
        visible = in_cache[:, None, :] & (k_pos[None, None, :] <= q_pos[:, a:b, None])  # [B, tq, L]
        scores = torch.einsum("bthr,blr->bhtl", q_lat[:, a:b], c32)
        scores = scores + torch.einsum("bthd,bld->bhtl", q_rope32[:, a:b], k_rope32)  # shared key dims
        scores = (scale * scores).masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [B, H, tq, L]
        # Attend in latent space, then absorb w_vc on the way out: probs @ (c @ w_vc[h].T).
        o_lat.append(torch.einsum("bhtl,blr->bthr", probs, c32))  # [B, tq, H, R]
    o_lat = o_lat[0] if len(o_lat) == 1 else torch.cat(o_lat, dim=1)
    o = torch.einsum("bthr,hvr->bthv", o_lat, w_vc.float())
    return o.to(q_nope.dtype)


def split_kv_b(
    kv_b_weight: Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[Tensor, Tensor]:
    """Split the checkpoint's ``kv_b_proj.weight`` into the absorbed-form matrices.

    Args:
        kv_b_weight: [H * (Dn + Dv), R]; the rows of head h are ``[k_nope (Dn) || v (Dv)]``.
        num_heads: H.
        qk_nope_head_dim: Dn.
        v_head_dim: Dv.

    Returns:
        (w_kc [H, Dn, R], w_vc [H, Dv, R]), views of ``kv_b_weight`` where possible, with
        ``k_nope_h = c @ w_kc[h].T`` and ``v_h = c @ w_vc[h].T``.
    """
    for name, n in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if kv_b_weight.ndim != 2 or kv_b_weight.shape[0] != rows:
        raise ValueError(
            f"kv_b_weight must have shape [num_heads * (qk_nope_head_dim + v_head_dim) = {rows}, R], "
            f"got {tuple(kv_b_weight.shape)}"
        )
    per_head = kv_b_weight.unflatten(0, (num_heads, qk_nope_head_dim + v_head_dim))
    w_kc, w_vc = per_head.split([qk_nope_head_dim, v_head_dim], dim=1)
    return w_kc, w_vc


@torch.no_grad()
def max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, segment_ids: torch.Tensor | None,
              block: int = 512, q_start: int = 0) -> torch.Tensor:
    """Largest causal pre-softmax logit of each head over the batch: [H] fp32 (QK-Clip's signal). Query i sits at
    position ``q_start + i`` of the keys k [B, Tk, H, D] (``q_start + Tq <= Tk``; segment_ids [B, Tk] the keys'
    document ids), as in ``mla_attention``: ``q_start > 0`` is a context-parallel segment's queries against the
    keys of the row up to its end. Queries are taken `block` at a time so memory stays O(block x Tk), not
    O(Tk^2)."""
    B, T, H, _ = q.shape
    kf = k.float()
    best = torch.full((H,), float("-inf"), device=q.device)
    pos = torch.arange(q_start + T, device=q.device)
    for s0 in range(0, T, block):
        s1 = min(T, s0 + block)
        e = q_start + s1  # keys visible to this block's last query
        s = torch.einsum("bihd,bjhd->bhij", q[:, s0:s1].float(), kf[:, :e]) * scale
        mask = pos[None, :e] <= pos[q_start + s0:e, None]  # [blk, e] causal
        mask = mask.expand(B, 1, s1 - s0, e)
        if segment_ids is not None:
            mask = mask & (segment_ids[:, None, q_start + s0:e, None] == segment_ids[:, None, None, :e])
        best = torch.maximum(best, s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)))
    return best


# --- op mla -----------------------------------------------------------------------------------------------


def _mla_attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, segment_ids: Tensor | None = None,
                             return_max_logit: bool = False, backends: Backends | None = None,
                             make_block_mask=None):
    """``mla_attention`` with ``max_logit`` beside it when asked for: the reference of op ``mla`` (it needs no
    block mask, so `make_block_mask` is never called)."""
    o = mla_attention(q, k, v, scale, segment_ids=segment_ids)
    return (o, max_logit(q, k, scale, segment_ids)) if return_max_logit else o


register(Op(
    "mla", reference=_mla_attention_reference,
    fast=(Fast("flex", mla_flex.mla_attention_flex_op, mla_flex.flex_available, validated=True),),
    tolerance="fp32 (eager flex): 1e-5; compiled bf16 against the fp32 reference: output and gradients 2e-2, the max "
              "logit 1e-2 (bf16 rounding of q.k)",
    options=("flex_autotune", "flex_kernel_options")))


def mla_attention_any(q: Tensor, k: Tensor, v: Tensor, scale: float, segment_ids: Tensor | None = None,
                      return_max_logit: bool = False, backends: Backends | None = None,
                      make_block_mask: Callable[[torch.device], object] | None = None):
    """Causal (document-masked with `segment_ids`) attention over the whole sequence, q_start = 0 and Tq = Tk (the
    training forward), on the implementation the registry picks for q (op ``mla``: compiled flex_attention on GPU).
    Returns o [B, T, H, Dv], or (o, max_logit [H] fp32) with `return_max_logit` (QK-Clip's signal).

    `make_block_mask(device)`: the flex block mask of `segment_ids` (the batch record's
    ``BatchInfo.flex_block_mask``, built once per batch for every layer and the recompute in backward), called only
    when flex runs with segment ids; None: :func:`causal_block_mask`."""
    return dispatch("mla", q, backends).fn(q, k, v, scale, segment_ids, return_max_logit, backends,
                                           make_block_mask=make_block_mask)
