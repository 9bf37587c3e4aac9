"""Kimi Delta Attention (KDA): reference implementations in plain PyTorch.

Per head, KDA keeps an fp32 state S in R^{K x V} and updates it token by token:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

with alpha_t = exp(g_t) a per-key-channel decay (g is the log-decay, g in (lower_bound, 0)),
beta_t in (0, 1) a per-head write strength, and q, k L2-normalized per head.

Layout follows flash-linear-attention: q, k, g are [B, T, H, K], v is [B, T, H, V],
beta is [B, T, H], states are [N, H, K, V]. With ``cu_seqlens`` (a LongTensor of N + 1 offsets,
B must be 1) the single row packs N independent sequences, each with its own initial and final
state. All math runs in fp32, also under autocast (which would otherwise run the matmuls in bf16:
KDA's state is fp32 by the spec); outputs come back in the input dtype, states stay fp32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops.precision import fp32_math

# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _shape_error(name: str, got, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {tuple(got)}, expected {expected}")


def _seq_bounds(cu_seqlens: Tensor | None, B: int, T: int) -> list[tuple[int, int]] | None:
    """Turn cu_seqlens into a list of (start, end) pairs, or None when the batch is not packed."""
    if cu_seqlens is None:
        return None
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed sequences), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise _shape_error("cu_seqlens", cu_seqlens.shape, "[N + 1] with N >= 1")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T} without decreasing, got {cu}")
    return list(zip(cu[:-1], cu[1:]))


def _check_state(state: Tensor | None, name: str, expected: tuple[int, ...], device) -> Tensor:
    """Validate a carried state and return it as fp32 (zeros when absent)."""
    if state is None:
        return torch.zeros(expected, dtype=torch.float32, device=device)
    if tuple(state.shape) != expected:
        raise _shape_error(name, state.shape, str(list(expected)))
    return state.float()


# --------------------------------------------------------------------------------------------
# Gate, normalization, short convolution
# --------------------------------------------------------------------------------------------


def kda_gate(z: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float = -5.0) -> Tensor:
    """Lower-bounded log-decay: g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias)).

    z is [..., H, K] decay logits, A_log is one scalar per head [H], dt_bias is [H * K] or
    [H, K]. Returns fp32 g with the shape of z. Since sigmoid lies in (0, 1), g lies in
    (lower_bound, 0): a token can never decay a channel by more than exp(lower_bound).
    """
    if z.dim() < 2:
        raise _shape_error("z", z.shape, "[..., H, K]")
    H, K = z.shape[-2:]
    if tuple(A_log.shape) != (H,):
        raise _shape_error("A_log", A_log.shape, f"[{H}] (one scalar per head)")
    if tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        raise _shape_error("dt_bias", dt_bias.shape, f"[{H * K}] or [{H}, {K}]")
    A = A_log.float().exp().view(H, 1)
    x = A * (z.float() + dt_bias.float().view(H, K))
    return lower_bound * torch.sigmoid(x)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32, returned in x.dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


@fp32_math
def short_conv(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor | None = None,
    activation: bool = True,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution over time, then SiLU.

    y_t[c] = sum_{w=0}^{W-1} weight[c, w] * x_{t - (W-1) + w}[c]   (tap W-1 is the current token)

    x is [B, T, C]; weight is [C, W] or [C, 1, W]; conv_state holds the last W-1 inputs
    (pre-conv) of each sequence, [N, C, W-1], oldest first, zeros when absent.
    Returns (y [B, T, C] in x.dtype, new_conv_state [N, C, W-1] fp32).

    Packed sequences (cu_seqlens) run in one pass over the packed row, each sequence preceded
    by its own carried inputs.
    """
    if x.dim() != 3:
        raise _shape_error("x", x.shape, "[B, T, C]")
    B, T, C = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C:
        raise _shape_error("weight", weight.shape, f"[{C}, W] or [{C}, 1, W]")
    W = weight.shape[1]
    bounds = _seq_bounds(cu_seqlens, B, T)
    N = B if bounds is None else len(bounds)
    state = _check_state(conv_state, "conv_state", (N, C, W - 1), x.device)
    w = weight.float()

    # Prepend the carried inputs so that every output sees exactly W taps: xp is [b, W-1+t, C].
    if bounds is None:
        xp = torch.cat([state.transpose(1, 2), x.float()], dim=1)
        y = sum(xp[:, i : i + T] * w[:, i] for i in range(W))
        # The new state is the last W-1 inputs; this also works when T < W-1.
        state = xp[:, xp.shape[1] - (W - 1) :].transpose(1, 2).contiguous()
    else:
        # One packed row with each sequence's carried inputs inserted in front of it:
        # ext = [state_0, x_0, state_1, x_1, ...], T + N (W-1) rows. Convolving ext as one
        # sequence gives every real token exactly its own W taps.
        D = W - 1
        starts, lengths = _starts_lengths(bounds, B, T)
        dev = x.device
        st = torch.tensor(starts, dtype=torch.long, device=dev)
        ln = torch.tensor(lengths, dtype=torch.long, device=dev)
        seq = torch.arange(N, device=dev)
        tok = torch.arange(T, device=dev)
        tok_seq = torch.repeat_interleave(seq, ln)
        block = st + seq * D  # where sequence i's block (state, then tokens) starts in ext
        src = torch.cat([x[0].float(), state.transpose(1, 2).reshape(N * D, C)])
        ext_idx = torch.empty(T + N * D, dtype=torch.long, device=dev)
        ext_idx[(block[:, None] + torch.arange(D, device=dev)).flatten()] = T + torch.arange(
            N * D, device=dev)
        ext_idx[tok + (tok_seq + 1) * D] = tok
        ext = src.index_select(0, ext_idx)
        n_out = ext.shape[0] - D
        y = sum(ext[i : i + n_out] * w[:, i] for i in range(W))  # row r: output at ext row r + D
        y = y.index_select(0, tok + tok_seq * D).unsqueeze(0)
        # The new state is the last W-1 rows of each block (for a sequence shorter than W-1
        # some of them are its carried inputs).
        tail = (block + ln)[:, None] + torch.arange(D, device=dev)
        state = ext.index_select(0, tail.flatten()).view(N, D, C).transpose(1, 2).contiguous()
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), state


# --------------------------------------------------------------------------------------------
# Layout: packed tokens <-> padded batches / flat chunk lists
# --------------------------------------------------------------------------------------------


def _starts_lengths(bounds, B: int, T: int) -> tuple[list[int], list[int]]:
    """Start offset and length of every sequence on the flattened [B * T] token axis."""
    if bounds is None:
        return [b * T for b in range(B)], [T] * B
    return [s for s, _ in bounds], [e - s for s, e in bounds]


def _pad_index(starts, lengths, total: int, device) -> tuple[Tensor, Tensor, int]:
    """Index maps between a token axis of length ``total`` and a padded batch [N, L].

    Every sequence is left-aligned in its row and padded at its END (L = the longest length).
    Returns (gather [N * L]: the token feeding each padded slot, ``total`` for padding, i.e.
    a zero row appended to the token axis; scatter [total]: the padded slot of each token; L).
    """
    N = len(lengths)
    L = max(lengths, default=0)
    st = torch.tensor(starts, dtype=torch.long, device=device)
    ln = torch.tensor(lengths, dtype=torch.long, device=device)
    p = torch.arange(L, device=device)
    gather = torch.where(p < ln[:, None], st[:, None] + p, total).flatten()
    seq = torch.repeat_interleave(torch.arange(N, device=device), ln)
    scatter = seq * L + torch.arange(total, device=device) - st[seq]
    return gather, scatter, L


def _chunk_index(starts, lengths, total: int, C: int, device):
    """Index maps for the chunked form.

    Each sequence is cut into ceil(len / C) chunks (the last one padded at its end with identity
    steps). All chunks of all sequences form one flat list, ordered for the state recurrence:
    by chunk index j first, then by sequence rank (sequences sorted by chunk count, longest
    first), so that step j of the recurrence owns one contiguous block of counts[j] chunks and
    the sequences still running at step j are ranks 0 .. counts[j] - 1.
    Returns (gather [M * C]: the token feeding each chunk slot, ``total`` = the zero padding
    row; scatter [total]: the chunk slot of each token; counts: list of n_max ints;
    perm [N]: sequence at each rank; rank [N]: rank of each sequence).

    The sizes are worked out on the host from the (host) starts and lengths, so nothing is read back
    from the device. Rows of one length (no cu_seqlens) get maps computed on the device from their sizes alone:
    no host-to-device copy either, so such a call can run under CUDA-graph capture (the maps then belong to the
    graph). Packed layouts keep the maps of the last few layouts (the KDA layers of one forward share one).
    """
    N = len(lengths)
    if N and all(ln == lengths[0] for ln in lengths) and list(starts) == [i * lengths[0] for i in range(N)]:
        return _uniform_chunk_index(N, lengths[0], C, torch.device(device))
    return _chunk_index_cached(tuple(starts), tuple(lengths), total, C, torch.device(device))


def _uniform_chunk_index(B: int, T: int, C: int, device: torch.device):
    """_chunk_index for B rows of T tokens each (row b = tokens b*T ...): every row has the same chunk count, so
    ranks are rows and step j's chunks are j*B ... j*B + B - 1. Device arithmetic only."""
    nc = -(-T // C)
    m = torch.arange(B * nc, device=device)
    j, row = m // B, m % B
    p = j[:, None] * C + torch.arange(C, device=device)
    gather = torch.where(p < T, row[:, None] * T + p, B * T).flatten()
    t = torch.arange(B * T, device=device)
    b, p = t // T, t % T
    scatter = ((p // C) * B + b) * C + p % C
    ident = torch.arange(B, device=device)
    return gather, scatter, [B] * nc, ident, ident


@functools.lru_cache(maxsize=8)
def _chunk_index_cached(starts: tuple, lengths: tuple, total: int, C: int, device: torch.device):
    N = len(lengths)
    n = [-(-ln // C) for ln in lengths]  # chunks per sequence
    perm_l = sorted(range(N), key=lambda i: -n[i])  # stable: ties keep sequence order
    rank_l = [0] * N
    for r, i in enumerate(perm_l):
        rank_l[i] = r
    n_max = max(n, default=0)
    at_least = [0] * (n_max + 1)  # at_least[j]: sequences with exactly j chunks, then suffix-summed
    for c in n:
        at_least[c] += 1
    counts = []  # counts[j]: sequences with more than j chunks
    running = N - at_least[0]
    for j in range(n_max):
        counts.append(running)
        running -= at_least[j + 1]
    M = sum(counts)
    st = torch.tensor(starts, dtype=torch.long, device=device)
    ln = torch.tensor(lengths, dtype=torch.long, device=device)
    perm = torch.tensor(perm_l, dtype=torch.long, device=device)
    rank = torch.tensor(rank_l, dtype=torch.long, device=device)
    cnt = torch.tensor(counts, dtype=torch.long, device=device)
    off = cnt.cumsum(0) - cnt  # first chunk of each step
    j = torch.repeat_interleave(torch.arange(n_max, device=device), cnt, output_size=M)  # step of each chunk
    seq = perm[torch.arange(M, device=device) - off[j]]  # its sequence
    p = j[:, None] * C + torch.arange(C, device=device)  # offset of each slot in the sequence
    gather = torch.where(p < ln[seq, None], st[seq, None] + p, total).flatten()
    tok_seq = torch.repeat_interleave(torch.arange(N, device=device), ln, output_size=total)
    p = torch.arange(total, device=device) - st[tok_seq]  # offset of each token in its sequence
    scatter = (off[p // C] + rank[tok_seq]) * C + p % C
    return gather, scatter, counts, perm, rank


# --------------------------------------------------------------------------------------------
# KDA
# --------------------------------------------------------------------------------------------


def _check_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Validate the KDA inputs; returns (B, T, H, K, V, starts, lengths, fp32 state, scale)."""
    if q.dim() != 4:
        raise _shape_error("q", q.shape, "[B, T, H, K]")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise _shape_error("k", k.shape, f"{[B, T, H, K]} (same as q)")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise _shape_error("v", v.shape, f"[{B}, {T}, {H}, V]")
    if tuple(g.shape) != (B, T, H, K):
        raise _shape_error("g", g.shape, f"{[B, T, H, K]} (same as q)")
    if tuple(beta.shape) != (B, T, H):
        raise _shape_error("beta", beta.shape, str([B, T, H]))
    V = v.shape[-1]
    bounds = _seq_bounds(cu_seqlens, B, T)
    N = B if bounds is None else len(bounds)
    state = _check_state(initial_state, "initial_state", (N, H, K, V), q.device)
    scale = K**-0.5 if scale is None else scale
    starts, lengths = _starts_lengths(bounds, B, T)
    return B, T, H, K, V, starts, lengths, state, scale


def _tokens_fp32(q, k, v, g, beta, scale) -> Tensor:
    """All per-token inputs as one fp32 tensor [B * T + 1, H, 3K + V + 1] (q already scaled):
    channels q | k | g | v | beta, plus a final all-zero row, the identity step used as padding
    (g = 0: no decay; beta = k = v = 0: no write; q = 0: no read)."""
    B, T, H, _ = q.shape
    x = torch.cat([q.float() * scale, k.float(), g.float(), v.float(), beta.float()[..., None]],
                  dim=-1)
    return F.pad(x.reshape(B * T, H, x.shape[-1]), (0, 0, 0, 0, 0, 1))


def _recurrent_core(q, k, v, g, beta, S):
    """Token loop on fp32 head-major inputs [b, H, t, D] (q already scaled), state [b, H, K, V]."""
    outs = []
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]
        S = S * g[:, :, t].exp().unsqueeze(-1)  # Diag(alpha_t) S_{t-1}
        kS = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the state currently predicts for k_t
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v_t - kS))  # delta-rule write
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # read the updated state
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


@fp32_math
def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """Token-by-token KDA (the decode path and the reference for the chunked form).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V].
    Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32).

    Packed sequences (cu_seqlens) run as one padded batch [N, max_len], each sequence padded at
    its end with identity steps, which change neither its outputs nor its final state.
    """
    B, T, H, K, V, starts, lengths, state, scale = _check_kda(
        q, k, v, g, beta, scale, initial_state, cu_seqlens)
    N = len(lengths)
    x = _tokens_fp32(q, k, v, g, beta, scale)
    if cu_seqlens is None:
        x = x[:-1].view(B, T, H, x.shape[-1])
        L = T
    else:
        gather, scatter, L = _pad_index(starts, lengths, B * T, q.device)
        x = x.index_select(0, gather).view(N, L, H, x.shape[-1])
    qf, kf, gf, vf, bf = x.transpose(1, 2).split([K, K, K, V, 1], dim=-1)
    o, state = _recurrent_core(qf, kf, vf, gf, bf[..., 0], state)  # o: [N, H, L, V]
    o = o.transpose(1, 2)
    if cu_seqlens is not None:
        o = o.reshape(N * L, H, V).index_select(0, scatter).view(B, T, H, V)
    return o.to(v.dtype), state


# Intra-chunk pair scores A[i, j] = sum_c x_i[c] k_j[c] exp(Gc_i[c] - Gc_j[c]) (j <= i), where
# Gc is the cumulative log-decay inside the chunk. Two exact ways to get them:
#
# * tiled (fast): split the chunk into tiles of _TILE = 16 tokens and factor every decay
#   through a reference position r of the key's tile b,
#       exp(Gc_i - Gc_j) = exp(Gc_i - Gc_r) * exp(Gc_r - Gc_j),
#   which turns the scores into plain matmuls. PRECONDITION: every g >= _TILED_G_MIN (-5, the
#   gate's lower bound, which kda_gate guarantees), so 16 steps decay by at most exp(-80)
#   (K3 report, section 2.1.1) and every factor below is finite and normal in fp32
#   (exp(80) ~ 5.5e34 < 3.4e38, exp(-80) ~ 1.8e-35 > 1.2e-38).
#   - rows i after tile b: r = the last position of tile b. Key factor in [exp(-75), 1]; row
#     factor <= 1 (where it underflows, the true score is smaller still).
#   - the diagonal block (i and j both in tile b): r = the position just before tile b (Gc = 0
#     for the first tile). Row factor in [exp(-80), 1], key factor in [1, exp(80)].
#   The reference never lies after row i, so an output cannot depend on later tokens, not even
#   through rounding; rows before tile b are masked out and never computed, so no exponent
#   needs clamping.
# * direct (slow fallback): materialize exp(Gc_i - Gc_j) as a [C, C, K] tensor per chunk.
#   Correct for any g; kda_chunk takes it whenever some g is below the bound (a cheap min()
#   check). Both are exact (same results up to fp32 rounding), only the speed differs.
_TILE = 16
_TILED_G_MIN = -5.0
_DIRECT_MAX_ELEMS = 1 << 24  # size of the [.., C, C, K] decay tensor built at once


def _tiles_are_exact(g: Tensor, g_min: float | None = None) -> bool:
    """Whether the tiled pair scores may be used for this g (see the note above). `g_min`, a lower bound on g that
    the caller guarantees (kda_gate's lower_bound), decides without reading g's minimum back from the device."""
    if g_min is not None and g_min >= _TILED_G_MIN * (1 + 1e-6):
        return True
    return g.numel() == 0 or float(g.detach().amin()) >= _TILED_G_MIN * (1 + 1e-6)


def _pair_scores_tiled(q, k, G):
    """(A_qk, A_kk) for chunks [..., C, K]: A_qk lower incl. the diagonal, A_kk strictly lower
    (beta not applied). Requires g >= _TILED_G_MIN, see the note above."""
    *lead, C, K = q.shape
    t = min(_TILE, C)
    nt = -(-C // t)
    Cp = nt * t
    X = torch.stack([q, k], dim=-3)  # [..., 2, C, K]: queries and keys share the row factors
    Xp, kp, Gp = X, k, G
    if Cp != C:  # ragged last tile: pad with k = q = 0 and a constant Gc (factor 1, no score)
        Xp, kp = F.pad(X, (0, 0, 0, Cp - C)), F.pad(k, (0, 0, 0, Cp - C))
        Gp = torch.cat([G, G[..., -1:, :].expand(*lead, Cp - C, K)], dim=-2)
    Gt = Gp.unflatten(-2, (nt, t))  # [..., nt, t, K]
    G_end = Gt[..., -1:, :]  # [..., nt, 1, K]: Gc at the last position of each tile
    G_start = F.pad(G_end[..., :-1, :, :], (0, 0, 0, 0, 1, 0))  # Gc just before each tile

    # Diagonal blocks (i, j in the same tile), all tiles at once, reference just before the
    # tile: row factor exp(Gc_i - Gc_start) in [exp(-80), 1], key factor in [1, exp(80)].
    rows = Xp.unflatten(-2, (nt, t)).transpose(-4, -3)  # [..., nt, 2, t, K]
    rows = (rows * (Gt - G_start).exp().unsqueeze(-3)).flatten(-3, -2)  # [..., nt, 2t, K]
    keys = kp.unflatten(-2, (nt, t)) * (G_start - Gt).exp()  # [..., nt, t, K]
    diag = (rows @ keys.transpose(-1, -2)).unflatten(-2, (2, t))  # [..., nt, 2, t, t]

    # Blocks below the diagonal (rows i after tile b), reference = the tile's last position:
    # key factor exp(Gc_end - Gc_j) in [exp(-75), 1], row factor exp(Gc_i - Gc_end) <= 1.
    keys = kp.unflatten(-2, (nt, t)) * (G_end - Gt).exp()  # [..., nt, t, K]
    cols = []
    for b in range(nt):
        lo, hi = b * t, (b + 1) * t
        parts = [diag[..., b, :, :, :]]
        if lo:
            parts.insert(0, X.new_zeros(*lead, 2, lo, t))  # rows before the tile: 0
        if hi < Cp:
            below = Xp[..., hi:, :] * (Gp[..., hi:, :] - G_end[..., b, :, :]).exp().unsqueeze(-3)
            below = below.flatten(-3, -2) @ keys[..., b, :, :].transpose(-1, -2)
            parts.append(below.unflatten(-2, (2, Cp - hi)))  # [..., 2, Cp - hi, t]
        cols.append(torch.cat(parts, dim=-2))
    A = torch.cat(cols, dim=-1)[..., :C, :C]  # [..., 2, C, C]
    A_qk, A_kk = A.unbind(-3)
    return A_qk.tril(), A_kk.tril(-1)


def _pair_scores_direct(q, k, G):
    """Same as _pair_scores_tiled, for any g, from the full [C, C, K] decay tensor.

    Inputs are [M, H, C, K]; the chunks are processed a few at a time to bound memory."""
    M, H, C, K = q.shape
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    step = max(1, _DIRECT_MAX_ELEMS // (H * C * C * K))
    A_qk, A_kk = [], []
    for s in range(0, M, step):
        sl = slice(s, s + step)
        # decay[i, j, c] = exp(Gc_i[c] - Gc_j[c]) for j <= i, else 0. Masking the difference
        # before exp keeps every exponent <= 0, so nothing overflows for any chunk size.
        diff = G[sl].unsqueeze(-2) - G[sl].unsqueeze(-3)  # [.., i, j, K]
        kd = k[sl].unsqueeze(-3) * torch.where(causal[..., None], diff, float("-inf")).exp()
        A_qk.append((q[sl].unsqueeze(-2) * kd).sum(-1))
        A_kk.append((k[sl].unsqueeze(-2) * kd).sum(-1))
    return torch.cat(A_qk), torch.cat(A_kk).tril(-1)


def _unit_lower_inverse(A: Tensor) -> Tensor:
    """(I + A)^{-1} for strictly lower triangular A [..., C, C], by recursive doubling.

    The inverse of [[I + A11, 0], [A21, I + A22]] is [[T11, 0], [-T22 A21 T11, T22]] with
    T11, T22 the inverses of the diagonal blocks; starting from 1 x 1 blocks (T = 1), every
    level merges all pairs of neighbouring blocks at once with two batched matmuls. Same
    accuracy as a triangular solve, but only matmuls: torch.linalg.solve_triangular on a large
    batch of small fp32 matrices is slow on CPU and very slow when its threads compete for
    cores. C need not be a power of two (A is padded with zeros, i.e. identity rows).
    """
    *lead, C, _ = A.shape
    P = 1 << (C - 1).bit_length()
    if P != C:
        A = F.pad(A, (0, P - C, 0, P - C))
    T = A.new_ones(*lead, P, 1, 1)  # inverses of the diagonal blocks, [..., P / s, s, s]
    s = 1
    while s < P:
        nb = P // (2 * s)
        diag = A.unflatten(-2, (nb, 2 * s)).unflatten(-1, (nb, 2 * s))
        A21 = diag.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)[..., s:, :s]  # [..., nb, s, s]
        T11, T22 = T[..., 0::2, :, :], T[..., 1::2, :, :]
        T21 = -(T22 @ A21 @ T11)
        T = torch.cat([torch.cat([T11, torch.zeros_like(T11)], dim=-1),
                       torch.cat([T21, T22], dim=-1)], dim=-2)
        s *= 2
    return T[..., 0, :C, :C]


def _kda_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, pairs="auto", g_min=None):
    """kda_chunk; ``pairs`` picks the intra-chunk pair scores: "auto" (tiled when g allows it),
    "tiled" or "direct" (the last two exist for tests)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if pairs not in ("auto", "tiled", "direct"):
        raise ValueError(f"pairs must be 'auto', 'tiled' or 'direct', got {pairs!r}")
    B, T, H, K, V, starts, lengths, S, scale = _check_kda(
        q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if B * T == 0:
        return v.new_zeros(v.shape), S
    C = chunk_size
    tiled = pairs == "tiled" or (pairs == "auto" and _tiles_are_exact(g, g_min))
    gather, scatter, counts, perm, rank = _chunk_index(starts, lengths, B * T, C, q.device)
    M = sum(counts)

    # 1. every chunk of every sequence at once, as a flat list [M, H, C, D]
    x = _tokens_fp32(q, k, v, g, beta, scale).index_select(0, gather)
    x = x.view(M, C, H, x.shape[-1]).transpose(1, 2)
    qc, kc, gc, vc, bc = (t.contiguous() for t in x.split([K, K, K, V, 1], dim=-1))  # bc: beta
    G = gc.cumsum(dim=-2)  # Gc_i: log-decay from the chunk start through token i
    A_qk, A_kk = (_pair_scores_tiled if tiled else _pair_scores_direct)(qc, kc, G)
    A_kk = A_kk * bc  # A_kk[i, j] = beta_i sum_c k_i[c] k_j[c] exp(Gc_i - Gc_j), j < i

    # UT transform: the per-token writes u_i = beta_i (v_i - S'_i^T k_i) satisfy
    # (I + A_kk) u = beta v - beta (k * Gamma) S, so with T = (I + A_kk)^{-1}:
    #   W = T (beta k Gamma),  U = T (beta v),  Vt = U - W S.
    Gamma = G.exp()
    G_last = G[..., -1:, :]  # [M, H, 1, K]
    Tinv = _unit_lower_inverse(A_kk)
    WU = Tinv @ torch.cat([bc * kc * Gamma, bc * vc], dim=-1)
    # S_next = Diag(exp(Gc_last)) S + sum_j (k_j * exp(Gc_last - Gc_j)) Vt_j^T
    KdT = (kc * (G_last - G).exp()).transpose(-1, -2)  # [M, H, K, C]
    d_last = G_last.transpose(-1, -2).exp()  # [M, H, K, 1]

    # 2. the state recurrence, one step per chunk index j, all sequences still running at once
    # (the chunk list is ordered so that step j owns a contiguous block, see _chunk_index).
    WU, KdT, d_last = WU.split(counts), KdT.split(counts), d_last.split(counts)
    S = S.index_select(0, perm)  # states by rank
    done, starts_S, Vts = [], [], []
    for j, n_run in enumerate(counts):
        if n_run < S.shape[0]:  # ranks >= n_run (shorter sequences) are done: final state
            done.append(S[n_run:])
            S = S[:n_run]
        W_j, U_j = WU[j].split([K, V], dim=-1)
        Vt = U_j - W_j @ S
        starts_S.append(S)
        Vts.append(Vt)
        S = S * d_last[j] + KdT[j] @ Vt
    S = torch.cat([S] + done[::-1]).index_select(0, rank)

    # 3. outputs of all chunks at once: o_i = (q_i * Gamma_i)^T S_start + sum_{j<=i} A_qk[i, j] Vt_j
    S0 = torch.cat(starts_S)  # [M, H, K, V], state at the start of each chunk
    Vt = torch.cat(Vts)  # [M, H, C, V]
    o = (qc * Gamma) @ S0 + A_qk @ Vt
    o = o.transpose(1, 2).reshape(M * C, H, V).index_select(0, scatter)
    return o.view(B, T, H, V).to(v.dtype), S


@fp32_math
def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64, g_min=None):
    """Chunkwise-parallel KDA: recurrent across chunks, parallel (WY/UT transform) inside one.

    Same contract and results as ``kda_recurrent``; T need not be a multiple of chunk_size.
    Everything inside the chunks is computed for all chunks (of all packed sequences) at once;
    only the state recurrence loops, once per chunk index. The intra-chunk decay uses 16-token
    tiles when every g >= -5 (kda_gate's default bound), and an exact but slower form otherwise.
    ``g_min``: a lower bound on g the caller guarantees (kda_gate's lower_bound); when it allows the tiles, g's
    minimum is not read back from the device. With it, and without cu_seqlens, the call reads nothing back, so a
    step of fixed shape can be captured in a CUDA graph.
    """
    return _kda_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, g_min=g_min)
