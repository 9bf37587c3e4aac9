"""KDA rollback by replay (report §5.4.2): rebuild the recurrent state and the short-conv tail after an accepted
prefix of verified draft tokens from the committed state and the tokens' cached projected inputs.

Speculative verification runs the draft window through KDA from the committed state without writing the advanced
state back (it would include rejected drafts). It keeps, per position, the post-conv q, k, v, the decay logits z,
the beta logits and the pre-conv q/k/v inputs: far smaller than a state per position. Once n positions are
accepted, those n are run through the recurrence again from the committed state, and the result (state and conv
tail) is written back once. No per-position snapshots exist anywhere.

`kda_replay` is the PyTorch reference and runs everywhere. Hook for the fused GPU kernel: the report fuses the
replay with the next draft window's verification (short conv, input norms, gate, recurrence and output norm in one
loop); a kernel for the replay alone takes these arguments and returns these two tensors, and plugs in by
registering it as this op's fast path (k3.ops.registry), tested against `kda_replay` in
tests/serve/spec/test_replay.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops import kda as ref


def kda_replay(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, pre_conv: Tensor, A_log: Tensor,
               dt_bias: Tensor, lower_bound: float, state: Tensor, conv: Tensor,
               lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Replay the first lengths[b] positions of row b from its committed state.

    q, k, v, z: [N, L, H, K] (q, k, v after the short conv and SiLU, q and k not yet L2-normalized; z the decay
    logits before dt_bias); beta_logits [N, L, H]; pre_conv [N, L, 3, P] the q/k/v inputs of the short convs;
    state [N, H, K, V] fp32 and conv [N, 3, P, W-1] fp32 (oldest first), the committed ones; lengths: N host ints
    in [1, L]. Returns (state [N, H, K, V] fp32, conv tails [N, 3, P, W-1] fp32) after each row's prefix: the
    token recurrence, equal to feeding those tokens one at a time (a row's positions past its length run as
    identity steps: no decay, no write)."""
    N, L = q.shape[:2]
    if len(lengths) != N or not all(1 <= n <= L for n in lengths):
        raise ValueError(f"lengths={lengths}: need {N} values in [1, {L}]")
    dev = q.device
    n = torch.tensor(lengths, device=dev)
    live = (torch.arange(L, device=dev)[None] < n[:, None]).float()  # [N, L]
    g = ref.kda_gate(z, A_log, dt_bias, lower_bound) * live[..., None, None]
    beta = torch.sigmoid(beta_logits.float()) * live[..., None]
    _, new_state = ref.kda_recurrent(ref.l2norm(q), ref.l2norm(k), v, g, beta, initial_state=state)
    # The conv tail is the last W-1 inputs: of [committed tail, the row's first n inputs], positions n .. n+W-2.
    D = conv.shape[-1]
    ext = torch.cat([conv.float(), pre_conv.float().permute(0, 2, 3, 1)], dim=-1)  # [N, 3, P, D + L]
    idx = (n[:, None] + torch.arange(D, device=dev)[None])[:, None, None, :].expand(N, 3, conv.shape[2], D)
    return new_state, ext.gather(-1, idx).contiguous()
