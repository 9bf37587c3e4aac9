"""Kimi Delta Attention (KDA): reference implementations in plain PyTorch.

Per head, KDA keeps an fp32 state S in R^{K x V} and updates it token by token:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

with alpha_t = exp(g_t) a per-key-channel decay (g is the log-decay, g in (lower_bound, 0)),
beta_t in (0, 1) a per-head write strength, and q, k L2-normalized per head.

Layout follows flash-linear-attention: q, k, g are [B, T, H, K], v is [B, T, H, V],
beta is [B, T, H], states are [N, H, K, V]. With ``cu_seqlens`` (a LongTensor of N + 1 offsets,
B must be 1) the single row packs N independent sequences, each with its own initial and final
state. All math runs in fp32; outputs come back in the input dtype, states stay fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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

    def conv(xs: Tensor, st: Tensor) -> tuple[Tensor, Tensor]:
        # Prepend the carried inputs so that every output sees exactly W taps.
        xp = torch.cat([st.transpose(1, 2), xs.float()], dim=1)  # [b, W-1+t, C]
        t = xs.shape[1]
        y = sum(xp[:, i : i + t] * w[:, i] for i in range(W))
        # The new state is the last W-1 inputs; this also works when t < W-1.
        new_state = xp[:, xp.shape[1] - (W - 1) :].transpose(1, 2).contiguous()
        return y, new_state

    if bounds is None:
        y, state = conv(x, state)
    else:
        pieces = [conv(x[:, s:e], state[i : i + 1]) for i, (s, e) in enumerate(bounds)]
        y = torch.cat([p[0] for p in pieces], dim=1)
        state = torch.cat([p[1] for p in pieces], dim=0)
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), state


# --------------------------------------------------------------------------------------------
# KDA cores. Inputs here are fp32, head-major [b, H, t, D], q already scaled; state [b, H, K, V].
# --------------------------------------------------------------------------------------------


def _recurrent_core(q, k, v, g, beta, S):
    outs = []
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]
        S = S * g[:, :, t].exp().unsqueeze(-1)  # Diag(alpha_t) S_{t-1}
        kS = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the state currently predicts for k_t
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v_t - kS))  # delta-rule write
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # read the updated state
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def _chunk_core(q, k, v, g, beta, S, chunk_size: int):
    b, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    # Pad to whole chunks with identity steps: g = 0 (no decay), beta = k = v = 0 (no write).
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    strict = causal.tril(-1)  # j < i
    eye = torch.eye(C, dtype=q.dtype, device=q.device)

    outs = []
    for start in range(0, T + pad, C):
        sl = slice(start, start + C)
        q_c, k_c, v_c, b_c = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl, None]
        G = g[:, :, sl].cumsum(dim=2)  # Gc_i: log-decay from the chunk start through token i
        # decay[i, j, c] = exp(Gc_i[c] - Gc_j[c]) for j <= i, else 0. Masking the difference
        # before exp keeps every exponent <= 0, so nothing overflows for any chunk size.
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # [b, H, i, j, K]
        decay = torch.where(causal[..., None], diff, float("-inf")).exp()
        # A_kk[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(Gc_i - Gc_j), strictly lower
        A_kk = (k_c.unsqueeze(3) * k_c.unsqueeze(2) * decay).sum(-1) * b_c
        A_kk = A_kk.masked_fill(~strict, 0.0)
        # A_qk[i, j] = sum_c q_i[c] k_j[c] exp(Gc_i - Gc_j), lower incl. diagonal
        A_qk = (q_c.unsqueeze(3) * k_c.unsqueeze(2) * decay).sum(-1)

        # UT transform: the per-token writes u_i = beta_i (v_i - S'_i^T k_i) satisfy
        # (I + A_kk) u = beta v - beta (k * Gamma) S, so with T = (I + A_kk)^{-1}:
        #   W = T (beta k Gamma),  U = T (beta v),  Vt = U - W S.
        Gamma = G.exp()
        rhs = torch.cat([b_c * k_c * Gamma, b_c * v_c], dim=-1)
        WU = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
        W, U = WU.split([K, V], dim=-1)
        Vt = U - W @ S

        # o_i = (q_i * Gamma_i)^T S + sum_{j <= i} A_qk[i, j] Vt_j
        outs.append((q_c * Gamma) @ S + A_qk @ Vt)
        # S_next = Diag(exp(Gc_last)) S + sum_j (k_j * exp(Gc_last - Gc_j)) Vt_j^T
        G_last = G[:, :, -1:]  # [b, H, 1, K]
        S = S * G_last.transpose(-1, -2).exp() + (k_c * (G_last - G).exp()).transpose(-1, -2) @ Vt
    o = torch.cat(outs, dim=2)[:, :, :T] if outs else v.new_zeros(v.shape)
    return o, S


def _run(core, q, k, v, g, beta, scale, initial_state, cu_seqlens, **kwargs):
    """Validate, move to fp32 head-major layout, run ``core`` per batch or per packed sequence."""
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

    qf, kf, vf, gf = (x.float().transpose(1, 2) for x in (q, k, v, g))
    qf = qf * scale
    bf = beta.float().transpose(1, 2)
    if bounds is None:
        o, state = core(qf, kf, vf, gf, bf, state, **kwargs)
    else:
        pieces = [
            core(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], gf[:, :, s:e], bf[:, :, s:e],
                 state[i : i + 1], **kwargs)
            for i, (s, e) in enumerate(bounds)
        ]
        o = torch.cat([p[0] for p in pieces], dim=2)
        state = torch.cat([p[1] for p in pieces], dim=0)
    return o.transpose(1, 2).to(v.dtype), state


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """Token-by-token KDA (the decode path and the reference for the chunked form).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [N, H, K, V].
    Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32).
    """
    return _run(_recurrent_core, q, k, v, g, beta, scale, initial_state, cu_seqlens)


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64):
    """Chunkwise-parallel KDA: recurrent across chunks, parallel (WY/UT transform) inside one.

    Same contract and results as ``kda_recurrent``; T need not be a multiple of chunk_size.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _run(_chunk_core, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                chunk_size=chunk_size)
