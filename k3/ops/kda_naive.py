"""Kimi Delta Attention written for reading, not speed: the definition the optimized forms are tested against.

Two forms of the same map, both in a high precision (fp64 by default) with plain Python loops:

* ``kda_recurrent_naive``: the recurrence of report §2.1.1 token by token, every factor of the update spelled out
  as a matrix, S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t);
* ``kda_chunk_naive``: the textbook chunkwise form, one chunk at a time: the WY/UT transform turns the chunk's
  token updates into one triangular solve, and the state passes from chunk to chunk.

They take the raw inputs of op ``kda`` (k3.ops.kda_backend.kda) in its argument order and apply its input
preprocessing themselves, written out again rather than imported, so a test of the optimized code checks that too:
the lower-bounded per-channel log-decay g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias)), so alpha_t =
exp(g_t) lies in (exp(lower_bound), 1); beta = sigmoid(beta_logits); q and k L2-normalized per head (x / sqrt(|x|^2
+ 1e-6), as k3.ops.kda.l2norm); scale = K^-0.5 unless given. Nothing here is used by the model.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kda_chunk_naive", "kda_recurrent_naive"]


def _prepare(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, scale, dtype):
    """Op kda's preprocessing in `dtype`: (q, k, v, g, beta, scale, the sequences as (row, start, end), S0)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, z, beta_logits = (x.to(dtype) for x in (q, k, v, z, beta_logits))
    g = lower_bound * torch.sigmoid(A_log.to(dtype).exp().view(H, 1) * (z + dt_bias.to(dtype).view(H, K)))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(beta_logits)
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens packs the sequences into one row, got B={B}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        seqs = [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    S0 = (torch.zeros(len(seqs), H, K, V, dtype=dtype, device=q.device) if initial_state is None
          else initial_state.to(dtype))
    return q, k, v, g, beta, scale, seqs, S0


def kda_recurrent_naive(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, A_log: Tensor,
                        dt_bias: Tensor, lower_bound: float, initial_state: Tensor | None = None,
                        cu_seqlens: Tensor | None = None, *, scale: float | None = None,
                        dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """KDA token by token, exactly as defined: per head,

        S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale * q_t).

    q, k, z: [B, T, H, K] (q, k before the L2 norm; z the decay logits before dt_bias); v: [B, T, H, V];
    beta_logits: [B, T, H]; A_log: [H]; dt_bias: [H * K]; initial_state: [N, H, K, V] (zeros when None);
    cu_seqlens: N + 1 offsets of the sequences packed in one row (B = 1), each with its own state.
    Returns (o [B, T, H, V], final states [N, H, K, V]), both in `dtype`."""
    q, k, v, g, beta, scale, seqs, S0 = _prepare(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound,
                                                 initial_state, cu_seqlens, scale, dtype)
    K = q.shape[-1]
    eye = torch.eye(K, dtype=dtype, device=q.device)
    o = torch.zeros(v.shape, dtype=dtype, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        S = S0[n]  # [H, K, V]
        for t in range(start, end):
            k_t, v_t, b_t = k[b, t], v[b, t], beta[b, t, :, None, None]  # [H, K], [H, V], [H, 1, 1]
            alpha = torch.diag_embed(g[b, t].exp())  # Diag(alpha_t), [H, K, K]
            erase = eye - b_t * k_t[:, :, None] * k_t[:, None, :]  # I - beta_t k_t k_t^T
            S = erase @ alpha @ S + b_t * k_t[:, :, None] * v_t[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, scale * q[b, t])  # S_t^T (scale q_t)
        finals.append(S)
    return o, torch.stack(finals)


def kda_chunk_naive(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, A_log: Tensor,
                    dt_bias: Tensor, lower_bound: float, initial_state: Tensor | None = None,
                    cu_seqlens: Tensor | None = None, *, chunk_size: int = 64, scale: float | None = None,
                    dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """KDA chunk by chunk, the same contract as :func:`kda_recurrent_naive` (the last chunk of a sequence may be
    shorter). Inside a chunk of L tokens starting from state S, with G_i = g_1 + ... + g_i the log-decay from the
    chunk start through token i (per channel), the recurrence reads S_i = Diag(alpha_i) S_{i-1} + k_i u_i^T with
    the write u_i = beta_i (v_i - (Diag(alpha_i) S_{i-1})^T k_i). Unrolled,

        S_i = Diag(exp G_i) S + sum_{j<=i} Diag(exp(G_i - G_j)) k_j u_j^T,

    so the writes solve one unit lower triangular system (the UT transform),

        (I + A) U = beta V - beta (K * exp G) S,   A_ij = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c]) (j < i),

    that is U = U0 - W S with W = (I + A)^-1 (beta K exp G) and U0 = (I + A)^-1 (beta V) (the WY form: they do not
    depend on S). Then o_i = scale q_i^T S_i and the next chunk starts from S_L."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    q, k, v, g, beta, scale, seqs, S0 = _prepare(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound,
                                                 initial_state, cu_seqlens, scale, dtype)
    o = torch.zeros(v.shape, dtype=dtype, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        S = S0[n]  # [H, K, V], the state entering the chunk
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            L = c1 - c0
            qc, kc, vc = (x[b, c0:c1].transpose(0, 1) for x in (q, k, v))  # [H, L, K or V]
            bc = beta[b, c0:c1].transpose(0, 1)[..., None]  # [H, L, 1]
            G = g[b, c0:c1].transpose(0, 1).cumsum(1)  # [H, L, K]
            # decay[h, i, j, c] = exp(G_i[c] - G_j[c]) for j <= i, else 0 (masked before exp: no overflow)
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            decay = torch.where(causal[..., None], G[:, :, None] - G[:, None, :], float("-inf")).exp()
            A = bc * torch.einsum("hic,hijc,hjc->hij", kc, decay, kc).tril(-1)
            I_A = torch.eye(L, dtype=dtype, device=q.device) + A
            W = torch.linalg.solve_triangular(I_A, bc * kc * G.exp(), upper=False, unitriangular=True)
            U0 = torch.linalg.solve_triangular(I_A, bc * vc, upper=False, unitriangular=True)
            U = U0 - W @ S  # the writes u_i, [H, L, V]
            # o_i = scale q_i^T (Diag(exp G_i) S + sum_{j<=i} Diag(exp(G_i - G_j)) k_j u_j^T)
            scores = torch.einsum("hic,hijc,hjc->hij", qc, decay, kc)  # j <= i, diagonal included
            o[b, c0:c1] = (scale * ((qc * G.exp()) @ S + scores @ U)).transpose(0, 1)
            S = G[:, -1, :, None].exp() * S + (kc * (G[:, -1:] - G).exp()).transpose(1, 2) @ U  # S_L
        finals.append(S)
    return o, torch.stack(finals)
