"""KDA context parallelism (KCP, report §5.1.2), and what a packed row needs around it under context parallelism:
its split into per-rank segments, Gated MLA's keys from earlier segments (and QK-Clip's max logits over them), the
short conv's carried inputs, the MTP layer's tokens from the next segments.

A packed row (B = 1, documents given by cu_seqlens) is cut into P contiguous segments, one per rank of the CP
group. KDA applies the token matrix M_t = (I - beta_t k_t k_t^T) Diag(alpha_t) to the state before each write
(k3.ops.kda), so a segment acts on the state entering it as an affine map (report Eq. 17):

    S_out = M S_in + S~,   M = M_T ... M_1  [H, K, K],   S~ = the state leaving it when S_in = 0  [H, K, V].

Each rank computes (M, S~) from its own tokens, one all-gather exchanges them, and rank i folds S <- M_j S + S~_j
over the segments j < i in order (a prefix scan of affine maps) to recover its exact incoming state; then it runs
ordinary KDA on its segment, the incoming state being the initial state of its first (partial) document. A
document start inside segment j makes the state leaving j independent of the state entering it: its M is 0, so
the fold restarts there without a branch, and the flag "this segment holds a document start" travels as M = 0.
The collectives are autograd-aware (all-gather forward, reduce-scatter backward): gradients reach the other ranks'
inputs through M and S~, so forward and backward are exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from k3.model.batch import BatchInfo, packed_cu_seqlens
from k3.ops.kda import kda_chunk, kda_gate, l2norm
from k3.ops.mla import max_logit, mla_attention
from k3.ops.precision import fp32_math

__all__ = ["CPSegment", "CPBatch", "even_split_points", "cp_plan", "split_rows", "merge_rows", "split_packed_batch",
           "segment_fragments", "compose_incoming", "kcp_reference", "all_gather_autograd", "kda_context_parallel",
           "kda_cp", "all_gather_rows", "mla_context_parallel", "conv_halo", "rows_after", "mtp_lengths",
           "ContextParallelRecord", "aligned_labels", "cp_batch_info"]

# kda_chunk's contract: (q, k, v, g, beta, scale=, initial_state=, cu_seqlens=) -> (o, final_state [N, H, K, V]).
KDAFn = Callable[..., tuple[Tensor, Tensor]]

# --------------------------------------------------------------------------------------------
# The split of a packed row into segments
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CPSegment:
    """One rank's share of a packed row.

    start, end: its token range [start, end) in the row. cu_seqlens: its documents' offsets, local (0 ... end -
    start), int64 on the host. continued: whether its first document began on an earlier rank (False on rank 0 and
    where a document starts at the segment's first token); only such a document takes an incoming state.
    lengths: every segment's length in rank order (the MLA gather pads rows to the longest)."""

    rank: int
    start: int
    end: int
    cu_seqlens: Tensor
    continued: bool
    lengths: tuple[int, ...]


def _offsets(cu_seqlens: Tensor | Sequence[int], T: int, name: str = "cu_seqlens") -> list[int]:
    """Document offsets as host ints, checked to rise strictly from 0 to T."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must rise strictly from 0 to {T} (the segment's tokens), got {cu}")
    return cu


def even_split_points(T: int, P: int) -> list[int]:
    """The P - 1 cut positions of a row of T tokens into P segments whose lengths differ by at most one."""
    if P < 1 or T < P:
        raise ValueError(f"cannot cut {T} tokens into {P} non-empty segments")
    return [T * i // P for i in range(1, P)]


def cp_plan(cu_seqlens: Tensor | Sequence[int], split_points: Sequence[int]) -> list[CPSegment]:
    """Cut a packed row with document offsets `cu_seqlens` [N + 1] at `split_points` (rising positions strictly
    inside the row, one fewer than the ranks) into segments with local document offsets; a document crossing a cut
    continues on the next rank."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    T = cu[-1] if cu else 0
    _offsets(cu, T)
    cuts = [0, *(int(p) for p in split_points), T]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"split_points must rise strictly inside (0, {T}), got {list(split_points)}")
    lengths = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    starts = set(cu[:-1])
    return [CPSegment(r, a, b, torch.tensor([0, *(c - a for c in cu if a < c < b), b - a], dtype=torch.long),
                      a not in starts, lengths)
            for r, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def split_rows(x: Tensor, plan: Sequence[CPSegment], dim: int = 1) -> list[Tensor]:
    """A per-token tensor of the whole row (tokens along `dim`) -> every segment's slice (views)."""
    return [x.narrow(dim, s.start, s.end - s.start) for s in plan]


def merge_rows(parts: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The inverse of split_rows: the segments' per-token tensors, in rank order, as one row."""
    return torch.cat(list(parts), dim=dim)


@dataclass(frozen=True)
class CPBatch:
    """One rank's share of a packed batch: its segment and its slices [1, T_i] of the row's token ids, labels and
    document ids (global ids, so that MLA matches keys gathered from other ranks)."""

    segment: CPSegment
    input_ids: Tensor
    segment_ids: Tensor
    labels: Tensor | None


def split_packed_batch(input_ids: Tensor, segment_ids: Tensor, num_ranks: int, labels: Tensor | None = None,
                       split_points: Sequence[int] | None = None) -> list[CPBatch]:
    """Split a packed row [1, T] (token ids, document ids, labels) into `num_ranks` contiguous segments, of even
    lengths unless `split_points` says where to cut. `labels` must already be aligned with the positions (the
    target of position t at t): the next token of a segment's last position lives on the next rank. Each
    segment's local cu_seqlens restart at its first token (CPSegment)."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one packed row [1, T], got shape {tuple(input_ids.shape)}")
    for name, t in (("segment_ids", segment_ids), ("labels", labels)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(t.shape)}")
    T = input_ids.shape[1]
    points = even_split_points(T, num_ranks) if split_points is None else list(split_points)
    if len(points) != num_ranks - 1:
        raise ValueError(f"{num_ranks} ranks need {num_ranks - 1} split points, got {points}")
    plan = cp_plan(packed_cu_seqlens(segment_ids.cpu()), points)
    ids, seg = split_rows(input_ids, plan), split_rows(segment_ids, plan)
    lab = split_rows(labels, plan) if labels is not None else [None] * len(plan)
    return [CPBatch(s, i, d, y) for s, i, d, y in zip(plan, ids, seg, lab)]


# --------------------------------------------------------------------------------------------
# KCP math (single process)
# --------------------------------------------------------------------------------------------


@fp32_math
def segment_fragments(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens_local: Tensor | Sequence[int],
                      continued: bool, kda_fn: KDAFn = kda_chunk) -> tuple[Tensor, Tensor, bool]:
    """One segment's KCP fragments (report Eq. 17): (M [H, K, K], S~ [H, K, V], has_start), fp32.

    k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H] (q plays no part in the state). Over the tokens after the
    segment's last document start (all of them when none starts in it), M = M_T ... M_1 maps the state entering
    them to the state leaving the segment, and S~ is the state leaving it when that state is 0. has_start: a
    document starts in the segment (inside it, or at its first token when not `continued`); then what leaves it
    does not depend on what entered, and M = 0.

    Both come from one chunkwise KDA pass (`kda_fn`) over those tokens with K extra value columns: with values
    [0 | v] and initial state [I | 0], the state recurrence, linear in every column, ends at [M | S~]. The cost is
    one KDA pass of value width K + V: the intra-chunk work (pair scores, UT inverse) of a plain pass, and a state
    recurrence over K + V columns instead of V: O(T (C + K) (K + V)) per head for chunks of C tokens, where the
    product of the T token matrices would cost O(T K^3). The pass's outputs (zero queries) are discarded."""
    if k.dim() != 4 or k.shape[0] != 1:
        raise ValueError(f"KCP runs one packed row: k must be [1, T, H, K], got shape {tuple(k.shape)}")
    cu = _offsets(cu_seqlens_local, k.shape[1], "cu_seqlens_local")
    has_start = len(cu) > 2 or not continued
    k, v, g, beta = (t[:, cu[-2]:] for t in (k, v, g, beta))
    _, T, H, K = k.shape
    V = v.shape[-1]
    q0 = torch.zeros_like(k)
    if has_start:
        _, S = kda_fn(q0, k, v, g, beta, scale=1.0, initial_state=None, cu_seqlens=None)
        return S.new_zeros(H, K, K), S[0], True
    eye = torch.eye(K, dtype=torch.float32, device=k.device).expand(1, H, K, K)
    S0 = torch.cat([eye, eye.new_zeros(1, H, K, V)], dim=-1)
    v_aug = torch.cat([v.new_zeros(1, T, H, K), v], dim=-1)
    _, S = kda_fn(q0, k, v_aug, g, beta, scale=1.0, initial_state=S0, cu_seqlens=None)
    M, S_t = S[0].split([K, V], dim=-1)
    return M, S_t, False


def compose_incoming(fragments: Sequence[tuple[Tensor, Tensor, bool | None]], rank: int) -> Tensor:
    """The state entering segment `rank` ([H, K, V]; rank = P: the state leaving the row): S <- M_j S + S~_j over
    the segments j < rank in order, from S = 0 (report §5.1.2). `fragments`: every segment's (M, S~, has_start).
    The fold starts at the last segment with has_start True; None ("not known here") is safe too, as such a
    segment's M is 0."""
    S = torch.zeros_like(fragments[0][1])
    first = max((j for j in range(rank) if fragments[j][2]), default=0)
    for M, S_t, _ in fragments[first:rank]:
        S = M @ S + S_t
    return S


def _run_segment(q, k, v, g, beta, scale, cu_seqlens: Tensor, n_docs: int, incoming: Tensor, kda_fn: KDAFn):
    """Ordinary KDA over one segment, `incoming` [H, K, V] the initial state of its first document."""
    init = torch.cat([incoming[None], incoming.new_zeros(n_docs - 1, *incoming.shape)])
    return kda_fn(q, k, v, g, beta, scale=scale, initial_state=init, cu_seqlens=cu_seqlens)


@fp32_math
def kcp_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                  cu_seqlens: Tensor, split_points: Sequence[int], kda_fn: KDAFn = kda_chunk) -> tuple[Tensor, Tensor]:
    """KCP simulated in one process: cut the row at `split_points`, compute every segment's fragments, compose each
    incoming state, run every segment. Same contract as kda_chunk over the whole row [1, T]: (o [1, T, H, V],
    final_state [N, H, K, V] fp32); it tests the math of kda_context_parallel without processes."""
    plan = cp_plan(cu_seqlens, split_points)
    parts = list(zip(*(split_rows(t, plan) for t in (q, k, v, g, beta))))
    frags = [segment_fragments(k_i, v_i, g_i, b_i, s.cu_seqlens, s.continued, kda_fn)
             for s, (_, k_i, v_i, g_i, b_i) in zip(plan, parts)]
    outs, finals = [], []
    for s, x in zip(plan, parts):
        S_in = compose_incoming(frags, s.rank) if s.continued else torch.zeros_like(frags[s.rank][1])
        o, final = _run_segment(*x, scale, s.cu_seqlens.to(q.device), len(s.cu_seqlens) - 1, S_in, kda_fn)
        outs.append(o)
        # the last document's state is not final where it continues on the next rank
        finals.append(final[:-1] if s.rank + 1 < len(plan) and plan[s.rank + 1].continued else final)
    return merge_rows(outs), torch.cat(finals)


# --------------------------------------------------------------------------------------------
# Distributed KCP
# --------------------------------------------------------------------------------------------


def _collective(name: str, older: str):
    """A collective under its current name, or the name older torch releases give it."""
    return getattr(dist, name, None) or getattr(dist, older)


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim, [P, *x.shape]. Backward: every rank's copy of x fed that rank's loss, so
    x's gradient is the sum over ranks of their slice for it: one reduce-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty(dist.get_world_size(group) * x.numel())
        _collective("all_gather_single", "all_gather_into_tensor")(out, x.view(-1), group=group)
        return out.view(-1, *x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gx = grad.new_empty(grad.shape[1:])
        _collective("reduce_scatter_single", "reduce_scatter_tensor")(gx.view(-1), grad.contiguous().view(-1),
                                                                      group=ctx.group)
        return gx, None


def all_gather_autograd(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """x of every rank of `group`, stacked in rank order [P, *x.shape]; autograd-aware (reduce-scatter backward)."""
    return _AllGather.apply(x, group)


def _tied(x: Tensor, own: Tensor) -> Tensor:
    """x plus a zero multiple of this rank's slice of a gathered buffer. Every rank must enter the gather's backward
    (a collective), also one whose result does not depend on the others (rank 0, a segment that starts a
    document); the zero term puts the gather in its graph."""
    return x + 0.0 * own.sum() if own.requires_grad else x


def _check_rank(continued: bool, rank: int) -> None:
    if continued and rank == 0:
        raise ValueError("continued=True on rank 0: the first segment's first document cannot begin on an earlier "
                         "rank")


@fp32_math
def kda_context_parallel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                         cu_seqlens_local: Tensor, group: dist.ProcessGroup | None, continued: bool,
                         kda_fn: KDAFn = kda_chunk) -> tuple[Tensor, Tensor]:
    """KDA over this rank's segment of a packed row split across the CP process group `group` (report §5.1.2).

    q, k, g [1, T_i, H, K], v [1, T_i, H, V], beta [1, T_i, H]: this rank's tokens (q, k L2-normalized, g the
    log-decay, as in k3.ops.kda); cu_seqlens_local: its documents' offsets 0 ... T_i; continued: whether its first
    document began on an earlier rank (CPSegment.continued). Returns (o [1, T_i, H, V], final_state [N_i, H, K, V]
    fp32, each local document's state at its end in this segment), the rows of kda_chunk over the whole row.
    Communication: one all-gather of the fragments, P x H K (K + V) fp32 whatever T_i; its backward is one
    reduce-scatter, through which the gradient reaches the other ranks' k, v, g, beta. `kda_fn` runs the fragment
    pass and the segment (kda_chunk's contract; a fast kernel with an initial state and its gradient fits)."""
    rank = dist.get_rank(group)
    _check_rank(continued, rank)
    cu = _offsets(cu_seqlens_local, q.shape[1], "cu_seqlens_local")
    M, S_t, _ = segment_fragments(k, v, g, beta, cu, continued, kda_fn)
    H, K, V = S_t.shape
    buf = all_gather_autograd(torch.cat([M.flatten(), S_t.flatten()]), group)  # [P, H K (K + V)]
    frags = [(b[: H * K * K].view(H, K, K), b[H * K * K:].view(H, K, V), None) for b in buf.unbind(0)]
    S_in = compose_incoming(frags, rank) if continued else torch.zeros_like(S_t)
    S_in = _tied(S_in, buf[rank])
    cu_t = cu_seqlens_local if isinstance(cu_seqlens_local, Tensor) else torch.tensor(cu, device=q.device)
    return _run_segment(q, k, v, g, beta, scale, cu_t.to(q.device), len(cu) - 1, S_in, kda_fn)


def kda_cp(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, A_log: Tensor, dt_bias: Tensor,
           lower_bound: float, cu_seqlens_local: Tensor, group: dist.ProcessGroup | None,
           continued: bool, backends=None) -> tuple[Tensor, Tensor]:
    """The layer's op entry (k3.ops.kda_backend.kda: raw decay logits z and beta logits, q, k before their L2 norm)
    under KCP: the gate, norms and sigmoid as its reference applies them, then kda_context_parallel with the
    chunked KDA the registry picks (op ``kda_chunk``: the reference, or fla-core's chunk_kda when asked for)."""
    from k3.ops.registry import dispatch

    g = kda_gate(z, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logits.float())
    # g >= lower_bound by construction: the chunked form need not read min(g) back to pick its tiled pair scores
    chunk = functools.partial(dispatch("kda_chunk", q, backends).fn, g_min=lower_bound)
    return kda_context_parallel(l2norm(q.float()), l2norm(k.float()), v, g, beta, None, cu_seqlens_local, group,
                                continued, chunk)


# --------------------------------------------------------------------------------------------
# Gated MLA and the short conv under context parallelism
# --------------------------------------------------------------------------------------------


def all_gather_rows(x: Tensor, group: dist.ProcessGroup | None, lengths: Sequence[int]) -> Tensor:
    """Every rank's rows x [1, T_r, ...] in rank order, as one row [1, sum(lengths), ...]; autograd-aware. `lengths`:
    every rank's T_r (rows travel padded to the longest)."""
    rank = dist.get_rank(group)
    if x.shape[1] != lengths[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[1]} rows, lengths says {lengths[rank]}")
    L = max(lengths)
    rows = x[0] if x.shape[1] == L else torch.cat([x[0], x.new_zeros(L - x.shape[1], *x.shape[2:])])
    gathered = all_gather_autograd(rows, group)
    return torch.cat([gathered[j, :n] for j, n in enumerate(lengths)])[None]


def mla_context_parallel(q: Tensor, c: Tensor, k_rope: Tensor, kv_up: Callable[[Tensor], Tensor], scale: float,
                         segment_ids: Tensor, group: dist.ProcessGroup | None, lengths: Sequence[int],
                         return_max_logit: bool = False):
    """Gated MLA's attention core (k3.ops.mla.mla_attention, report §2.1.2) for this rank's segment of a packed
    row: its queries against the keys of this and every earlier segment, causal and within each document.

    What travels is the latent, c [1, T_i, R] and the shared key dims k_rope [1, T_i, Dr] (R + Dr numbers a token),
    not the per-head keys and values (H (Dn + Dv)); every rank expands the earlier segments' latent itself with
    `kv_up` (the layer's kv_b_proj, [.., R] -> [.., H (Dn + Dv)]). q [1, T_i, H, Dn + Dr]; segment_ids [1, T_i]
    global document ids (split_packed_batch keeps them global; a second, integer all-gather shares them);
    lengths: every rank's segment length. Returns o [1, T_i, H, Dv], the rows of mla_attention over the whole row.
    The earlier ranks' c and k_rope get their gradient through the gather's backward; kv_up's weight gradient is
    this rank's part, summed over the CP group like a data-parallel gradient.

    With `return_max_logit`, (o, max_logit [H] fp32, detached): each head's largest scaled logit of this segment's
    queries over the keys they see (QK-Clip's signal, report §3.3). Every query of the row lives on one rank and
    sees there the keys it sees in one process, so the MAX over the CP group (the trainer all-reduces the maxima
    over every rank) is the single-process maximum."""
    _, T, H, D = q.shape
    R, Dr = c.shape[-1], k_rope.shape[-1]
    Dn = D - Dr
    rank = dist.get_rank(group)
    start = sum(lengths[:rank])
    end = start + T
    rows = all_gather_rows(torch.cat([c, k_rope], dim=-1), group, lengths)[:, :end]
    ids = all_gather_rows(segment_ids, group, lengths)[:, :end]
    c_all, kr = rows.split([R, Dr], dim=-1)
    kv = kv_up(c_all)
    Dv = kv.shape[-1] // H - Dn
    k_nope, v = kv.view(1, end, H, Dn + Dv).split([Dn, Dv], dim=-1)
    k = torch.cat([k_nope, kr[:, :, None].expand(1, end, H, Dr)], dim=-1)
    o = mla_attention(q, k, v, scale, q_start=start, segment_ids=ids)
    return (o, max_logit(q, k, scale, ids, q_start=start)) if return_max_logit else o


def conv_halo(x: Tensor, width: int, cu_seqlens_local: Tensor, group: dist.ProcessGroup | None,
              continued: bool) -> Tensor:
    """The short conv's carried inputs (k3.ops.kda.short_conv's conv_state, [N_i, C, W - 1]) for this rank's
    segment x [1, T_i, C] (pre-conv): for a continued first document, the previous segment's last W - 1 rows (of its
    last document only, zeros before that document's start); zeros for every other document. One all-gather of
    [W - 1, C] a rank, autograd-aware. Every segment must hold at least W - 1 tokens."""
    D = width - 1
    _, T, C = x.shape
    cu = _offsets(cu_seqlens_local, T, "cu_seqlens_local")
    rank = dist.get_rank(group)
    _check_rank(continued, rank)
    if T < D:
        raise ValueError(f"a segment of {T} tokens is shorter than the conv's {D} carried inputs")
    pos = torch.arange(T - D, T, device=x.device)
    tail = x[0, T - D:] * (pos >= cu[-2]).to(x.dtype)[:, None]  # the last document's rows only
    gathered = all_gather_autograd(tail, group)  # [P, D, C]
    halo = _tied(gathered[rank - 1] if continued else torch.zeros_like(tail), gathered[rank])
    return torch.cat([halo.t()[None], x.new_zeros(len(cu) - 2, C, D)])


def rows_after(x: Tensor, n: int, group: dist.ProcessGroup | None, lengths: Sequence[int]) -> Tensor:
    """The first rows of the row after this rank's segment: x [1, T_i, ...] (integer per-token values: token ids,
    document ids, labels) -> [1, h, ...], the first h = min(n, rows after this segment) rows of the later segments
    in rank order (h = 0 on the last rank). What the MTP layer reads at a segment's end (token t + d of its last
    positions). One all-gather of each rank's first n rows; no gradient."""
    rank, P = dist.get_rank(group), len(lengths)
    if x.shape[1] != lengths[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[1]} rows, lengths says {lengths[rank]}")
    head = x[0, :n]
    if head.shape[0] < n:
        head = torch.cat([head, head.new_zeros(n - head.shape[0], *head.shape[1:])])
    gathered = head.new_empty(P, *head.shape)
    _collective("all_gather_single", "all_gather_into_tensor")(gathered.view(-1), head.contiguous().view(-1),
                                                              group=group)
    later = [gathered[j, :min(n, lengths[j])] for j in range(rank + 1, P)]
    return torch.cat([head[:0], *later])[:n][None]


def mtp_lengths(lengths: Sequence[int], d: int) -> tuple[int, ...]:
    """Every segment's length for the MTP block at depth d (k3.model.mtp), whose position t holds token t + d: the
    row's positions [0, T - d), cut where the backbone's are, so the last segment is d shorter. Every segment must
    keep at least one position."""
    T, start, out = sum(lengths), 0, []
    for n in lengths:
        out.append(min(start + n, T - d) - start)
        start += n
    if min(out) < 1:
        raise ValueError(f"segments of {tuple(lengths)} tokens leave an empty segment for the MTP block at depth {d}: "
                         f"every segment needs more than {d} tokens")
    return tuple(out)


# --------------------------------------------------------------------------------------------
# The model's hook: k3.model.batch.ContextParallel
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ContextParallelRecord:
    """k3.model.batch.ContextParallel for one rank's segment: the CP group, whether its first document began on an
    earlier rank, and every segment's length. Put it on the segment's BatchInfo (`cp_batch_info`), and the model's
    KDA, short conv and Gated MLA layers run their collective forms (kda_cp, conv_halo, mla_context_parallel); the
    MTP layers read the next segments' first tokens (rows_after) and run Gated MLA over their own segments'
    lengths (`shifted`)."""

    group: dist.ProcessGroup | None
    continued: bool
    lengths: tuple[int, ...]

    def kda(self, q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens, backends=None):
        return kda_cp(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens, self.group,
                      self.continued, backends)[0]

    def conv_halo(self, x, width, cu_seqlens):
        return conv_halo(x, width, cu_seqlens, self.group, self.continued)

    def mla(self, q, c, k_rope, kv_up, scale, segment_ids, return_max_logit=False):
        return mla_context_parallel(q, c, k_rope, kv_up, scale, segment_ids, self.group, self.lengths,
                                    return_max_logit)

    def rows_after(self, x, n):
        return rows_after(x, n, self.group, self.lengths)

    def shifted(self, d):
        return replace(self, lengths=mtp_lengths(self.lengths, d))

    def token_count(self, n: Tensor) -> Tensor:
        n = n.detach().clone()
        dist.all_reduce(n, group=self.group)
        return n


def aligned_labels(labels: Tensor, fill: float = -100) -> Tensor:
    """Labels as the model takes them (aligned with input_ids, shifted inside) -> the target of position t at t
    (`fill` at the row's last position, which has none), which split_packed_batch and a context-parallel forward
    expect. Any per-token tensor [rows, T, ...] aligned like the labels (a token's behaviour log-prob, advantage)
    is realigned the same way, with its own `fill` (k3.train.losses)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1, *labels.shape[2:]), fill)], dim=1)


def cp_batch_info(part: CPBatch, group: dist.ProcessGroup | None):
    """The BatchInfo of one rank's segment (host tensors; `.to(device)` moves it), with its ContextParallelRecord."""
    s = part.segment
    return BatchInfo.from_segment_ids(part.segment_ids, cu_seqlens_cpu=s.cu_seqlens,
                                      context=ContextParallelRecord(group, s.continued, s.lengths))
