"""MoonEP: perfectly balanced expert parallelism with dynamic redundant experts (report §5.2.1, appendix E).

Setting. E routed experts are sharded contiguously over R expert-parallel ranks: expert ``e`` lives on its home
rank ``e // (E/R)``. Every rank routes S tokens to K experts each, so the group holds R*S*K token-expert pairs
and a balanced plan makes every rank compute exactly ``T = S*K`` of them, whatever the router did. To get
there a rank may host redundant copies of non-local experts (at most E/R of them) and compute some of their
pairs; the planner decides, from the group's per-expert loads of the current micro-batch and layer, which
copies each rank hosts and how each expert's pairs are split among its home rank and its copies.

Why E/R slots always suffice (appendix E, Theorem 1). Start with every pair computed at home; ranks are then
underloaded or overloaded against T. Repeatedly fill one underloaded rank exactly up to T with pairs of one
overloaded rank's experts; the source may stay overloaded, become balanced, or turn underloaded (and be filled
later). A filled rank never changes again, so there are at most R-1 fills, and each rank's remote pairs come
from a single source rank, whose experts number E/R: no rank ever needs more than E/R copies.

The planner runs this construction, with the choices the proof leaves open made to use few copies:

* order: the underloaded rank with the largest deficit is filled first (ties: lowest rank).
* source: the overloaded rank that covers the deficit with the fewest of its experts (ties: the most loaded,
  then lowest rank). Such a fill always exists and costs at most E/R copies: an overloaded rank has never been
  filled, so it holds only its home experts, whose pairs exceed T >= the deficit.
* several sources: when the largest remaining experts of all overloaded ranks together cover the deficit with
  strictly fewer experts than that single-source fill, the fill takes them instead (each source may again stay
  overloaded, balance, or turn underloaded). A rank filled so still gets fewer copies than the lemma's fill
  would give it, so the E/R bound stands; it beats a single source on cases such as two overloaded ranks
  whose largest experts together exactly cover an empty rank.
* experts: the fewest that cover the deficit (the largest-first count), and among such sets a best fit: each
  next expert is the smallest that still lets the rest be covered by the largest others. Large experts stay
  for later fills and whole experts move where possible, the expert-wise migration of Theorem 2's tightness
  proof; at most the last expert of a fill is split between its home and the filled rank.

The tests compare the result with ``plan_exact`` (the optimum, by exhaustive search) on tiny cases, and with
Theorem 2's tight instance. Planning is host-side Python over ranks: one device-to-host read of the E loads, then
at most R-1 fills; each fill scans the O(R) overloaded ranks (a bisection over each one's E/R sorted prefix
sums) and, when several sources may do better, merges their sorted experts (O(E log R)); so O(R^2 log(E/R))
steps in the common case and O(R E log R) at worst, plus O(E R) tensor work to build the plan. It is
deterministic: the same loads give the same plan on every rank.

Dispatch. All pairs of one expert are ordered stably: by the rank that routed them, then by position in that
rank's row-major [S, K] routing tensor (token, then slot). Each expert's pairs are cut, in that order, into
contiguous ranges, one per computing rank in ascending rank order, of lengths ``assign[e, r]``. Rank r's
receive buffer has exactly T rows, grouped by expert in ascending expert order (``row_start[:, r]``), so its
grouped GEMM has static total size. Per layer a rank needs: every rank's router counts (an all-gather of [E]
ints; their sum is the planner's ``loads``, their exclusive prefix over ranks, ``rank_offsets``, its ``base``);
the plan, computed identically everywhere; the weights of ``redundant[r]`` fetched from their home ranks
``e // (E/R)`` (and their gradients reduced back in the backward pass); and ``pair_slots``, which gives each of
its pairs the computing rank and the row there, so a fused permute can write every pair straight to its final
position (the zero-copy path of §5.2.1) and the combine reads the results back from the same places.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MoonEPPlan", "plan_moon_ep", "plan_exact", "pair_destinations", "pair_slots", "rank_offsets"]


@dataclass(frozen=True)
class MoonEPPlan:
    """A balanced MoonEP plan for one micro-batch and layer (report §5.2.1).

    Tensors live on the device of the planner's ``loads``; all are int64.
    """

    num_experts: int  # E
    num_ranks: int  # R
    pairs_per_rank: int  # T = S*K: pairs every rank computes
    redundant: Tensor  # [R, E/R] experts rank r hosts as copies, ascending, padded with -1
    assign: Tensor  # [E, R] pairs of expert e computed by rank r; rows sum to the loads, columns to T
    row_start: Tensor  # [E, R] first row of (e, r)'s range in rank r's [T] receive buffer (expert-grouped)
    # The non-empty (expert, rank) ranges, expert-major and in ascending rank order within an expert: the lookup
    # table from a pair's position in the global stable order to its computing rank and buffer row.
    seg_expert: Tensor  # [M] expert of each range
    seg_rank: Tensor  # [M] computing rank
    seg_end: Tensor  # [M] end (exclusive) of the range in the global pair order, strictly increasing
    seg_row: Tensor  # [M] row of the range's first pair in seg_rank's receive buffer

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def loads(self) -> Tensor:
        """[E] pairs of each expert over the group."""
        return self.assign.sum(1)

    @property
    def num_redundant(self) -> Tensor:
        """[R] copies hosted by each rank."""
        return (self.redundant >= 0).sum(1)

    @property
    def max_redundant(self) -> int:
        """The plan's objective: most copies on any rank (at most E/R)."""
        return int(self.num_redundant.max())


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_loads(loads: Tensor, num_ranks: int, tokens_per_rank_pairs: int) -> list[int]:
    """Validate the planner's inputs; return the loads as a host list."""
    if not isinstance(loads, Tensor) or loads.ndim != 1:
        raise ValueError(f"loads must be a 1-D [E] tensor, got {type(loads).__name__} "
                         f"of shape {tuple(getattr(loads, 'shape', ()))}")
    if loads.dtype.is_floating_point or loads.dtype.is_complex or loads.dtype == torch.bool:
        raise ValueError(f"loads must be an integer tensor, got dtype {loads.dtype}")
    _check_int("num_ranks", num_ranks, 1)
    _check_int("tokens_per_rank_pairs", tokens_per_rank_pairs, 1)
    E = loads.numel()
    if E == 0 or E % num_ranks:
        raise ValueError(f"the number of experts E={E} must be a positive multiple of num_ranks={num_ranks}")
    host = loads.tolist()
    if min(host) < 0:
        e = min(range(E), key=host.__getitem__)
        raise ValueError(f"loads must be non-negative, got loads[{e}] = {host[e]}")
    if sum(host) != num_ranks * tokens_per_rank_pairs:
        raise ValueError(f"loads must sum to num_ranks * tokens_per_rank_pairs = {num_ranks} * "
                         f"{tokens_per_rank_pairs} = {num_ranks * tokens_per_rank_pairs}, got {sum(host)}")
    return host


def _best_fit(items: list[tuple[int, int]], need: int, limit: int) -> list[tuple[int, int]] | None:
    """Moves [(expert, pairs)] covering ``need`` with the fewest experts, or None if that takes over ``limit``.

    ``items`` are (-pairs, expert) sorted ascending, i.e. largest first, all with pairs > 0; it is consumed.
    The fewest experts are what the largest-first order needs (c); among sets of c, each next expert is the
    smallest that still lets the rest be covered by the c-1 largest others, so large experts are kept for
    later fills and whole experts move where possible; at most the last move splits an expert.
    """
    moves: list[tuple[int, int]] = []
    while need > 0:
        total = c = 0
        for neg, _ in items:
            total, c = total - neg, c + 1
            if total >= need:
                break
        else:
            return None
        if len(moves) + c > limit:
            return None
        # The smallest expert x with x + (sum of the c-1 largest) >= need: the last one at or above the threshold.
        threshold = need - (total + items[c - 1][0])
        neg, e = items.pop(bisect.bisect_right(items, (-threshold, math.inf)) - 1)
        moves.append((e, min(-neg, need)))
        need += neg
    return moves


def plan_moon_ep(loads: Tensor, num_ranks: int, tokens_per_rank_pairs: int) -> MoonEPPlan:
    """Plan redundant experts so every rank computes exactly ``tokens_per_rank_pairs`` pairs (§5.2.1, app. E).

    Args:
        loads: [E] int pairs routed to each expert over the whole EP group (the router's per-expert counts,
            all-reduced over the group), summing to ``num_ranks * tokens_per_rank_pairs``.
        num_ranks: the EP size R; E must be a multiple of it.
        tokens_per_rank_pairs: T = S*K, the pairs each rank routes and, under the plan, computes.

    Returns:
        A MoonEPPlan with at most E/R copies on every rank (see the module docstring for the algorithm).
    """
    host = _check_loads(loads, num_ranks, tokens_per_rank_pairs)
    E, R, T = len(host), num_ranks, tokens_per_rank_pairs
    n = E // R
    rem = list(host)  # pairs of each expert still computed at home
    cur = [sum(host[r * n:(r + 1) * n]) for r in range(R)]  # each rank's current load

    def sorted_home(s: int) -> list[tuple[int, int]]:
        return sorted((-rem[e], e) for e in range(s * n, (s + 1) * n) if rem[e] > 0)

    desc = [sorted_home(s) for s in range(R)]  # remaining home experts, largest first
    prefix = [list(itertools.accumulate((-neg for neg, _ in d), initial=0)) for d in desc]
    under = [(cur[r] - T, r) for r in range(R) if cur[r] < T]  # heap: largest deficit, then lowest rank
    heapq.heapify(under)
    over = {r for r in range(R) if cur[r] > T}  # never filled, so they hold only their home experts
    moves: list[tuple[int, int, int]] = []  # (expert, filled rank, pairs)
    while under:
        _, u = heapq.heappop(under)
        need = T - cur[u]
        # The lemma's fill: the overloaded rank that covers the deficit with the fewest experts. It always
        # exists (an overloaded rank's home load exceeds T >= need) and costs at most its E/R experts.
        c1, _, o = min((bisect.bisect_left(prefix[s], need, 1), -cur[s], s) for s in over)
        fill = None
        if c1 > 1:  # several sources, only if that takes strictly fewer experts
            top = list(itertools.islice(heapq.merge(*(desc[s] for s in over)), c1 - 1))
            if -sum(neg for neg, _ in top) >= need:
                fill = _best_fit(list(heapq.merge(*(desc[s] for s in over))), need, c1 - 1)
        if fill is None:
            fill = _best_fit(list(desc[o]), need, n)
        if fill is None:  # ruled out by the lemma; a failure here is a planner bug
            raise RuntimeError(f"no fill of rank {u} (deficit {need}) from rank {o} within E/R = {n} experts")
        touched = set()
        for e, a in fill:
            rem[e] -= a
            cur[e // n] -= a
            touched.add(e // n)
            moves.append((e, u, a))
        cur[u] = T
        for s in sorted(touched):
            desc[s] = sorted_home(s)
            prefix[s] = list(itertools.accumulate((-neg for neg, _ in desc[s]), initial=0))
            if cur[s] <= T:
                over.discard(s)
                if cur[s] < T:
                    heapq.heappush(under, (cur[s] - T, s))
    return _build_plan(loads.device, E, R, T, rem, moves)


def _build_plan(device: torch.device, E: int, R: int, T: int, rem: list[int],
                moves: list[tuple[int, int, int]]) -> MoonEPPlan:
    n = E // R
    assign = torch.zeros(E, R, dtype=torch.int64)
    assign[torch.arange(E), torch.arange(E) // n] = torch.tensor(rem, dtype=torch.int64)
    per_rank: list[list[int]] = [[] for _ in range(R)]
    for e, u, _ in moves:
        per_rank[u].append(e)
    for u, es in enumerate(per_rank):
        if len(es) > n:  # the lemma rules this out; a failure here is a planner bug
            raise RuntimeError(f"rank {u} got {len(es)} redundant experts, more than E/R = {n}")
    redundant = torch.tensor([sorted(es) + [-1] * (n - len(es)) for es in per_rank], dtype=torch.int64)
    if moves:
        mv = torch.tensor(moves, dtype=torch.int64)
        assign[mv[:, 0], mv[:, 1]] = mv[:, 2]
    row_start = assign.cumsum(0) - assign  # rank r's buffer: its experts' ranges in ascending expert order
    nz = assign.reshape(-1).nonzero().flatten()  # expert-major, so each expert's ranges go in rank order
    return MoonEPPlan(
        num_experts=E, num_ranks=R, pairs_per_rank=T,
        redundant=redundant.to(device), assign=assign.to(device), row_start=row_start.to(device),
        seg_expert=(nz // R).to(device), seg_rank=(nz % R).to(device),
        seg_end=assign.reshape(-1)[nz].cumsum(0).to(device), seg_row=row_start.reshape(-1)[nz].to(device),
    )


def rank_offsets(counts: Tensor) -> Tensor:
    """[R, E] per-rank router counts -> [R, E] pairs of each expert on lower ranks: each rank's ``base``.

    A rank's dispatcher passes its row as ``base`` to ``pair_destinations`` / ``pair_slots``; the counts are the
    group's all-gathered ``expert_load`` of every rank (their sum over ranks is the planner's loads).
    """
    if counts.ndim != 2:
        raise ValueError(f"counts must be a [R, E] tensor, got shape {tuple(counts.shape)}")
    counts = counts.long()
    return counts.cumsum(0) - counts


def _locate(plan: MoonEPPlan, expert_ids: Tensor, base: Tensor | None, check: bool = True) -> tuple[Tensor, Tensor]:
    """(computing rank, receive-buffer row) of each pair of ``expert_ids``, flattened row-major. `check` validates
    the ids and `base` against the plan (two device-to-host reads); the expert-parallel layer, whose ids come from
    the router and whose bases from the same counts as the plan, passes False."""
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise ValueError(f"expert_ids must be an integer tensor, got dtype {expert_ids.dtype}")
    E = plan.num_experts
    dev = plan.assign.device
    flat = expert_ids.reshape(-1).long().to(dev)
    if check and flat.numel() and bool(((flat < 0) | (flat >= E)).any()):
        raise ValueError(f"expert_ids must lie in [0, {E}), got min {int(flat.min())} max {int(flat.max())}")
    if base is None:
        base = torch.zeros(E, dtype=torch.int64, device=dev)
    elif base.shape != (E,):
        raise ValueError(f"base must be a [E={E}] tensor, got shape {tuple(base.shape)}")
    base = base.long().to(dev)
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))  # not bincount: on CUDA it reads the ids' max back
    loads = plan.loads
    bad = (base < 0) | (base + counts > loads) if check else None
    if check and bool(bad.any()):
        e = int(bad.nonzero()[0])
        raise ValueError(f"expert {e}: base {int(base[e])} + {int(counts[e])} routed pairs do not fit the "
                         f"plan's load {int(loads[e])}")
    # Index of each pair among this tensor's pairs of the same expert, in row-major order (a stable sort).
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = counts.cumsum(0) - counts
    within = torch.empty_like(flat)
    within[order] = torch.arange(flat.numel(), device=dev) - starts[sorted_ids]
    key = (loads.cumsum(0) - loads + base)[flat] + within  # position in the global stable order
    seg = torch.searchsorted(plan.seg_end, key, right=True)
    seg_len = plan.assign[plan.seg_expert, plan.seg_rank]
    row = plan.seg_row[seg] + key - (plan.seg_end[seg] - seg_len[seg])
    return plan.seg_rank[seg], row


def pair_destinations(plan: MoonEPPlan, expert_ids: Tensor, base: Tensor | None = None) -> Tensor:
    """Rank that computes each token-expert pair, shaped like ``expert_ids``.

    Args:
        plan: the layer's plan.
        expert_ids: integer routing tensor of any shape (e.g. [S, K] from ``Routing.indices``), read in row-major
            order; or the whole group's [R, S, K] with ``base`` None.
        base: [E] pairs of each expert that precede this tensor in the stable order (``rank_offsets(counts)[r]``
            for rank r's own [S, K]); None means zero.
    """
    return _locate(plan, expert_ids, base)[0].reshape(expert_ids.shape)


def pair_slots(plan: MoonEPPlan, expert_ids: Tensor, base: Tensor | None = None,
               check: bool = True) -> tuple[Tensor, Tensor]:
    """(rank, row) of each pair: its computing rank and its row in that rank's [T] expert-grouped receive buffer.

    Arguments as for ``pair_destinations``; ``check=False`` skips validating the ids and ``base`` against the plan
    (each check reads a flag back to the host). Over the whole group, the (rank, row) pairs are a bijection onto
    [R] x [T].
    """
    rank, row = _locate(plan, expert_ids, base, check)
    return rank.reshape(expert_ids.shape), row.reshape(expert_ids.shape)


def plan_exact(loads: Tensor, num_ranks: int, tokens_per_rank_pairs: int, max_candidates: int = 2_000_000) -> int:
    """The optimum min over plans of the most redundant experts on any rank (appendix E's M(I)), for tiny cases.

    Exhaustive: for m = 0, 1, ... every choice of m copies per rank (only of experts with pairs) is tested for
    a balanced assignment, which exists iff every set Q of ranks can be served by the experts they may compute:
    T*|Q| <= sum of the loads of those experts (Gale's supply-demand theorem; integral since T and the loads
    are). It searches all plans, not only those the planner's filling construction can reach.
    Raises ValueError when E > 16 or the search would test more than ``max_candidates`` choices.
    """
    host = _check_loads(loads, num_ranks, tokens_per_rank_pairs)
    E, R, T = len(host), num_ranks, tokens_per_rank_pairs
    n = E // R
    if E > 16:
        raise ValueError(f"plan_exact handles at most 16 experts, got E={E}")
    supply = [0] * (1 << E)  # supply[mask]: pairs of the experts in mask
    for mask in range(1, 1 << E):
        low = (mask & -mask).bit_length() - 1
        supply[mask] = supply[mask & (mask - 1)] + host[low]
    home = [sum(1 << e for e in range(r * n, (r + 1) * n)) for r in range(R)]
    cand = [[e for e in range(E) if e // n != r and host[e] > 0] for r in range(R)]
    popcount = [bin(q).count("1") for q in range(1 << R)]

    def balanced(masks: tuple[int, ...]) -> bool:
        union = [0] * (1 << R)
        for q in range(1, 1 << R):
            low = (q & -q).bit_length() - 1
            union[q] = union[q & (q - 1)] | masks[low]
            if T * popcount[q] > supply[union[q]]:
                return False
        return True

    tested = 0
    for m in range(n + 1):
        # Copies only help, so m copies per rank (or all candidates, if fewer) cover every plan with at most m.
        options = [[home[r] | sum(1 << e for e in c) for c in itertools.combinations(cand[r], min(m, len(cand[r])))]
                   for r in range(R)]
        size = 1
        for opt in options:
            size *= len(opt)
        tested += size
        if tested > max_candidates:
            raise ValueError(f"plan_exact: more than max_candidates={max_candidates} choices to test "
                             f"(E={E}, R={R}, m={m})")
        if any(balanced(masks) for masks in itertools.product(*options)):
            return m
    raise RuntimeError(f"no balanced plan within E/R = {n} copies per rank; appendix E rules this out")
