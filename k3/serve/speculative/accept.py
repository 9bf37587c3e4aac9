"""Which draft tokens a verification accepts, so that the output is the target model's (lossless).

Greedy requests accept draft token i while it equals the target's argmax at its position; the bonus token is the
target's argmax after the last accepted one. The output is token-identical to non-speculative greedy decoding.

Sampled requests follow speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft token d_i, drawn
from the draft's distribution q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)), p_i the target's
distribution at that position after temperature, top-k and top-p (k3.serve.sampling.probs). At the first
rejection the token is drawn from the normalized residual (p_i - q_i)+ instead, and nothing after it is kept; when
all are accepted a bonus token is drawn from the target's next distribution. Every emitted token is then
distributed as the target's. A deterministic draft (one token, q one-hot) is the special case q_i(d_i) = 1: accept
with probability p_i(d_i), else draw from p_i with d_i removed.
"""

from __future__ import annotations

import torch

from k3.serve.sampling import SamplingParams, probs


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None = None, target: list[int] | None = None) -> list[int]:
    """Verify one request's drafts. logits [k + 1, V]: the target's at the k + 1 verified positions (row i predicts
    the token after draft i, row 0 the first draft); drafts: the k draft tokens; q: the draft's distributions
    [k, V] (None: the drafts were chosen deterministically, q one-hot). `target` (greedy requests): the argmax of
    each row when the caller has read them back already (`greedy_targets`, one read-back for a whole batch).
    Returns the emitted tokens: the accepted drafts, then the corrected or bonus token (1 to k + 1 tokens)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {k} drafts: need k + 1")
    if params.temperature == 0:
        if target is None:
            target = logits.float().argmax(-1).tolist()  # one read-back
        elif len(target) != k + 1:
            raise ValueError(f"{len(target)} target tokens for {k} drafts: need k + 1")
        out = []
        for i, d in enumerate(drafts):
            if d != target[i]:
                break
            out.append(d)
        return out + [target[len(out)]]
    p = probs(logits, params)  # [k + 1, V]
    d = torch.tensor(drafts, device=p.device, dtype=torch.long)
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, d]
    q_d = q[rows, d].float() if q is not None else torch.ones_like(p_d)
    u = torch.rand(k, device=p.device, generator=generator)
    ok = (u * q_d < p_d).tolist()  # u < p / q without dividing by a zero q
    n = next((i for i, a in enumerate(ok) if not a), k)
    if n == k:
        return drafts + [int(torch.multinomial(p[k], 1, generator=generator))]
    if q is not None:
        residual = (p[n] - q[n].float()).clamp(min=0)
    else:
        residual = p[n].clone()
        residual[drafts[n]] = 0
    total = residual.sum()
    # p == q at this row leaves no residual mass, and then a rejection has probability 0: draw from p (a guard
    # against rounding only)
    dist = residual / total if float(total) > 0 else p[n]
    return drafts[:n] + [int(torch.multinomial(dist, 1, generator=generator))]


def greedy_targets(logits: torch.Tensor, rows: list[int]) -> dict[int, list[int]]:
    """The argmax tokens [T] of the verification rows `rows` of logits [B, T, V], read back at once: {row: tokens}.
    Every row greedy (the usual batch): the argmax of the whole tensor, with no index sent to the device and no
    gather of the rows."""
    if not rows:
        return {}
    if rows == list(range(logits.shape[0])):
        return dict(enumerate(logits.argmax(-1).tolist()))
    got = logits[torch.tensor(rows, device=logits.device)].argmax(-1).tolist()
    return dict(zip(rows, got))
