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

from k3.serve.sampling import SamplingParams, inverse_transform, probs_rows, uniforms


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None = None, target: list[int] | None = None) -> list[int]:
    """Verify one request's drafts. logits [k + 1, V]: the target's at the k + 1 verified positions (row i predicts
    the token after draft i, row 0 the first draft); drafts: the k draft tokens; q: the draft's distributions
    [k, V] (None: the drafts were chosen deterministically, q one-hot). `target` (greedy requests): the argmax of
    each row when the caller has read them back already (`greedy_targets`, one read-back for a whole batch).
    Returns the emitted tokens: the accepted drafts, then the corrected or bonus token (1 to k + 1 tokens).
    `accept_batch` of this one request."""
    return accept_batch([logits], [drafts], [q], [params], [generator], {} if target is None else {0: target})[0]


def accept_batch(logits: list[torch.Tensor], drafts: list[list[int]], qs: list[torch.Tensor | None],
                 params: list[SamplingParams], generators: list[torch.Generator | None],
                 targets: dict[int, list[int]] | None = None) -> list[list[int]]:
    """`accept` for the requests of a verification, request i with logits[i] [k_i + 1, V], drafts[i], qs[i],
    params[i], generators[i] and, greedy, targets[i] when read back already (else read here, all at once). The
    sampled requests are decided together: their distributions in one pass (k3.serve.sampling.probs_rows), the
    acceptance tests u_ij q_ij(d_ij) < p_ij(d_ij) of all of them read back once, the corrected or bonus tokens drawn
    in one pass from one uniform number each (k3.serve.sampling's inverse transform), read back once; each
    request's numbers come from its own generator (k uniforms, then one), so its tokens do not depend on the others."""
    n = len(logits)
    if not len(drafts) == len(qs) == len(params) == len(generators) == n:
        raise ValueError("accept_batch needs one of drafts, qs, params and generators per request")
    for x, d in zip(logits, drafts):
        if x.shape[0] != len(d) + 1:
            raise ValueError(f"{x.shape[0]} rows of logits for {len(d)} drafts: need k + 1")
    targets = dict(targets or {})
    for i, t in targets.items():
        if len(t) != len(drafts[i]) + 1:
            raise ValueError(f"{len(t)} target tokens for {len(drafts[i])} drafts: need k + 1")
    out: list[list[int] | None] = [None] * n
    greedy = [i for i in range(n) if params[i].temperature == 0]
    unread = [i for i in greedy if i not in targets]
    if unread:  # one read-back
        got = torch.cat([logits[i].float().argmax(-1) for i in unread]).tolist()
        for i in unread:
            targets[i], got = got[:len(drafts[i]) + 1], got[len(drafts[i]) + 1:]
    for i in greedy:
        acc = []
        for d, t in zip(drafts[i], targets[i]):
            if d != t:
                break
            acc.append(d)
        out[i] = acc + [targets[i][len(acc)]]
    sampled = [i for i in range(n) if params[i].temperature != 0]
    if sampled:
        for i, toks in zip(sampled, _speculative_sampling([logits[i] for i in sampled], [drafts[i] for i in sampled],
                                                        [qs[i] for i in sampled], [params[i] for i in sampled],
                                                        [generators[i] for i in sampled])):
            out[i] = toks
    return out


def _speculative_sampling(logits: list[torch.Tensor], drafts: list[list[int]], qs: list[torch.Tensor | None],
                          params: list[SamplingParams], generators: list) -> list[list[int]]:
    """The sampled requests' acceptance (the module docstring's rule), two read-backs for all of them."""
    dev = logits[0].device
    ks = [len(d) for d in drafts]
    offs = [sum(k + 1 for k in ks[:i]) for i in range(len(ks))]
    p = probs_rows(torch.cat(logits), [pp for pp, k in zip(params, ks) for _ in range(k + 1)])  # [sum(k + 1), V]
    rows = [offs[i] + j for i, k in enumerate(ks) for j in range(k)]
    toks = [d for ds in drafts for d in ds]
    tests = []
    if rows:
        r = torch.tensor(rows, device=dev)
        t = torch.tensor(toks, device=dev)
        p_d = p[r, t]
        q_d = torch.cat([q[torch.arange(k, device=dev), torch.tensor(d, device=dev, dtype=torch.long)].float()
                         if q is not None else torch.ones(k, device=dev)
                         for q, k, d in zip(qs, ks, drafts) if k])
        u = uniforms(ks, generators, dev)
        tests = (u * q_d < p_d).tolist()  # u < p / q without dividing by a zero q; one read-back
    accepted, final = [], []
    at = 0
    for i, k in enumerate(ks):
        ok = tests[at:at + k]
        at += k
        m = next((j for j, a in enumerate(ok) if not a), k)
        accepted.append(m)
        row = p[offs[i] + m]
        if m < k:  # rejected: the residual (p - q)+ of that position (p with the draft removed for a one-hot q)
            if qs[i] is not None:
                res = (row - qs[i][m].float()).clamp(min=0)
            else:
                res = row.clone()
                res[drafts[i][m]] = 0
            # p == q at this row leaves no residual mass, and then a rejection has probability 0: draw from p (a
            # guard against rounding only)
            row = torch.where(res.sum() > 0, res, row)
        final.append(row)
    u2 = uniforms([1] * len(generators), generators, dev)
    last = inverse_transform(torch.stack(final), u2).tolist()  # one read-back
    return [drafts[i][:m] + [last[i]] for i, m in enumerate(accepted)]


def greedy_targets(logits: torch.Tensor, rows: list[int],
                   drafts: dict[int, torch.Tensor] | None = None) -> dict[int, list[int]]:
    """The argmax tokens [T] of the verification rows `rows` of logits [B, T, V], read back at once: {row: tokens}.
    Every row greedy (the usual batch): the argmax of the whole tensor, with no index sent to the device and no
    gather of the rows. `drafts` ({row: its draft tokens on the device [k]}, greedy rows of one k): read back in the
    same transfer, after that row's targets (its list is T + k long)."""
    return GreedyReadBack(logits, rows, drafts).result()


class GreedyReadBack:
    """`greedy_targets` begun: the argmax (with the drafts after it, as there) computed and its copy to the host
    enqueued at construction, read at `result`, which waits for that copy alone: on a GPU, work enqueued after it
    (a drafting step run ahead) keeps the device busy while the host goes on. `top`: the targets on the device,
    [len(rows), T (+ k)] (None without rows)."""

    def __init__(self, logits: torch.Tensor, rows: list[int], drafts: dict[int, torch.Tensor] | None = None):
        drafts = drafts or {}
        self.rows, self.top, self._host, self._done = rows, None, None, None
        if not rows:
            if drafts:
                raise ValueError("drafts to read back for rows that are not greedy")
            return
        if set(drafts) - set(rows) or len({d.shape[0] for d in drafts.values()}) > 1:
            raise ValueError("greedy_targets reads back drafts of greedy rows only, all of one length")
        every = rows == list(range(logits.shape[0]))
        top = logits.argmax(-1) if every else logits[torch.tensor(rows, device=logits.device)].argmax(-1)
        if drafts:
            k = next(iter(drafts.values())).shape[0]
            pad = top.new_zeros(k)
            top = torch.cat([top, torch.stack([drafts.get(r, pad) for r in rows]).to(top.dtype)], dim=1)
        self.top = top
        if top.is_cuda:  # into pinned memory, asynchronously, with an event to wait for
            self._host = torch.empty(top.shape, dtype=top.dtype, pin_memory=True)
            self._host.copy_(top, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = top

    def result(self) -> dict[int, list[int]]:
        if self._done is not None:
            self._done.synchronize()
        return {} if self._host is None else dict(zip(self.rows, self._host.tolist()))
