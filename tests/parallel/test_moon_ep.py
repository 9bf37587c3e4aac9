"""MoonEP planner (report §5.2.1, appendix E): balance, the E/R bound, dispatch, and optimality on tiny cases."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.parallel.moon_ep import MoonEPPlan, pair_destinations, pair_slots, plan_exact, plan_moon_ep, rank_offsets

# Deterministic example generation: the same cases run everywhere, so a pass is reproducible.
FAST = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
KINDS = ["uniform", "one_expert", "one_rank", "zipf", "dirichlet", "empty_ranks", "near_uniform"]


def integer_loads(weights: list[float], total: int) -> torch.Tensor:
    """Loads proportional to ``weights`` (not all zero) summing exactly to ``total`` (largest remainders)."""
    w = [round(x * 10**6) for x in weights]
    if not any(w):
        w = [1] * len(w)
    W = sum(w)
    base = [x * total // W for x in w]
    frac = sorted((i for i in range(len(w)) if w[i] > 0), key=lambda i: (-(w[i] * total % W), i))
    for i in frac[:total - sum(base)]:
        base[i] += 1
    return torch.tensor(base, dtype=torch.int64)


def make_weights(kind: str, E: int, R: int, rng: random.Random) -> list[float]:
    n = E // R
    if kind == "uniform":
        return [1.0] * E
    if kind == "one_expert":  # every pair to one expert
        w = [0.0] * E
        w[rng.randrange(E)] = 1.0
        return w
    if kind == "one_rank":  # every pair to the experts of one rank
        r = rng.randrange(R)
        return [rng.random() + 0.01 if e // n == r else 0.0 for e in range(E)]
    if kind == "zipf":
        a = rng.uniform(0.5, 2.0)
        w = [1.0 / (i + 1) ** a for i in range(E)]
        rng.shuffle(w)
        return w
    if kind == "dirichlet":
        alpha = rng.choice([0.1, 0.5, 2.0])
        return [rng.gammavariate(alpha, 1.0) + 1e-6 for _ in range(E)]
    if kind == "empty_ranks":  # Theorem 2's shape: some ranks' experts get nothing, the rest share evenly
        empty = set(rng.sample(range(R), rng.randint(1, max(1, R - 1)))) if R > 1 else set()
        spread = rng.choice([0.0, 0.1, 1.0])
        return [0.0 if e // n in empty else 1.0 + spread * rng.random() for e in range(E)]
    if kind == "near_uniform":
        return [1.0 + rng.uniform(-0.5, 0.5) for _ in range(E)]
    raise AssertionError(kind)


@st.composite
def planner_cases(draw, shapes: list[tuple[int, int]], max_pairs: int):
    E, R = draw(st.sampled_from(shapes))
    T = draw(st.integers(1, max_pairs))
    kind = draw(st.sampled_from(KINDS + ["drawn"]))
    if kind == "drawn":
        weights = draw(st.lists(st.integers(0, 20), min_size=E, max_size=E))
    else:
        weights = make_weights(kind, E, R, random.Random(draw(st.integers(0, 2**16))))
    return E, R, T, integer_loads(weights, R * T)


def check_plan(plan: MoonEPPlan, loads: torch.Tensor, R: int, T: int) -> None:
    """Every invariant a dispatcher relies on."""
    E = loads.numel()
    n = E // R
    assert (plan.num_experts, plan.num_ranks, plan.pairs_per_rank) == (E, R, T)
    assert plan.assign.shape == (E, R) and plan.redundant.shape == (R, n)
    assert (plan.assign >= 0).all()
    assert torch.equal(plan.assign.sum(1), loads)  # each expert's pairs fully assigned
    assert (plan.assign.sum(0) == T).all()  # every rank computes exactly T pairs
    home = torch.arange(E) // n
    remote = (plan.assign > 0) & (home[:, None] != torch.arange(R)[None, :])  # [E, R] pairs computed by a copy
    used = remote.sum(0)
    assert (used <= n).all()  # the E/R bound
    # The slots hold exactly the used copies, ascending, padded with -1.
    expected = torch.full((R, n), -1, dtype=torch.int64)
    for r in range(R):
        es = remote[:, r].nonzero().flatten()
        expected[r, :es.numel()] = es
    assert torch.equal(plan.redundant, expected)
    assert plan.max_redundant == int(used.max())
    assert torch.equal(plan.row_start, plan.assign.cumsum(0) - plan.assign)
    nz = plan.assign.reshape(-1).nonzero().flatten()
    assert torch.equal(plan.seg_expert * R + plan.seg_rank, nz)
    assert torch.equal(plan.seg_end, plan.assign.reshape(-1)[nz].cumsum(0))
    assert torch.equal(plan.seg_row, plan.row_start[plan.seg_expert, plan.seg_rank])


# --- planner -------------------------------------------------------------------------------------------------


@FAST
@given(planner_cases([(1, 1), (4, 1), (2, 2), (4, 2), (8, 2), (6, 3), (12, 3), (8, 4), (16, 4), (10, 5),
                      (24, 8), (48, 8), (32, 16), (64, 16)], 300))
def test_plan_is_balanced_within_bound(case):
    E, R, T, loads = case
    plan = plan_moon_ep(loads, R, T)
    check_plan(plan, loads, R, T)
    assert plan.max_redundant <= E // R


@FAST
@given(planner_cases([(4, 2), (6, 2), (8, 2), (10, 2), (12, 2), (16, 2), (6, 3), (9, 3), (4, 4), (8, 4)], 60))
def test_planner_matches_exact_optimum_on_tiny_cases(case):
    """Equal to the exhaustive optimum on every generated case (and on the tens of thousands of random
    and adversarial tiny cases tried while designing the greedy); never above E/R."""
    E, R, T, loads = case
    got = plan_moon_ep(loads, R, T).max_redundant
    best = plan_exact(loads, R, T)
    assert best <= got <= E // R
    assert got == best


def test_several_sources_beat_the_single_source_lemma():
    # Rank 1 needs 6 pairs. One source needs 3 experts (3+2+2 of rank 0, or of rank 2); taking the 3 of
    # rank 0 and the 3 of rank 2 needs 2, the optimum.
    loads = torch.tensor([2, 3, 2, 2, 0, 0, 0, 0, 2, 2, 2, 3])
    plan = plan_moon_ep(loads, 3, 6)
    check_plan(plan, loads, 3, 6)
    assert plan_exact(loads, 3, 6) == 2 == plan.max_redundant
    assert plan.redundant[1].tolist() == [1, 11, -1, -1]


@pytest.mark.parametrize("E,R", [(6, 3), (12, 3), (8, 4), (16, 4), (896, 64), (896, 128)])
def test_theorem2_tight_instance(E, R):
    """Rank 0's experts get nothing, the rest share evenly: rank 0 needs ceil(E(R-1)/R^2) copies (appendix E)."""
    T = 16384 * 16 if E == 896 else E * (R - 1) * 5  # tiny: every other expert gets exactly 5 R^2 pairs
    n = E // R
    loads = integer_loads([0.0] * n + [1.0] * (E - n), R * T)
    plan = plan_moon_ep(loads, R, T)
    check_plan(plan, loads, R, T)
    bound = math.ceil(E * (R - 1) / R**2)
    assert plan.max_redundant == bound
    if E <= 12:
        assert plan_exact(loads, R, T) == bound


def test_named_extremes():
    E, R, T = 16, 4, 12
    # balanced at home: no copies
    plan = plan_moon_ep(torch.full((E,), R * T // E), R, T)
    assert plan.max_redundant == 0 and (plan.redundant == -1).all()
    # every pair to expert 5 (home rank 1): every other rank hosts exactly that one copy
    loads = torch.zeros(E, dtype=torch.int64)
    loads[5] = R * T
    plan = plan_moon_ep(loads, R, T)
    check_plan(plan, loads, R, T)
    assert plan.redundant[:, 0].tolist() == [5, -1, 5, 5] and (plan.redundant[:, 1:] == -1).all()
    assert plan.assign[5].tolist() == [T] * R


@pytest.mark.parametrize("R", [64, 128])
def test_release_shapes(R):
    E, T = 896, 16384 * 16
    for kind, seed in [("zipf", 0), ("dirichlet", 1), ("empty_ranks", 2), ("one_rank", 3)]:
        loads = integer_loads(make_weights(kind, E, R, random.Random(seed)), R * T)
        plan = plan_moon_ep(loads, R, T)
        check_plan(plan, loads, R, T)
        assert plan.max_redundant <= E // R


def test_deterministic():
    loads = integer_loads(make_weights("zipf", 64, 8, random.Random(7)), 8 * 1000)
    a, b = plan_moon_ep(loads, 8, 1000), plan_moon_ep(loads.clone(), 8, 1000)
    for f in ("redundant", "assign", "row_start", "seg_expert", "seg_rank", "seg_end", "seg_row"):
        assert torch.equal(getattr(a, f), getattr(b, f))


# --- dispatch ------------------------------------------------------------------------------------------------


def routed_ids(kind: str, E: int, R: int, S: int, K: int, seed: int) -> torch.Tensor:
    """[R, S, K] distinct top-K experts of noisy logits with a skew of the given kind."""
    g = torch.Generator().manual_seed(seed)
    n = E // R
    if kind == "same_expert":  # every token to experts 0..K-1: one rank's experts take everything
        return torch.arange(K).expand(R, S, K).clone()
    skew = torch.zeros(E)
    if kind == "hot_rank":
        skew[:n] = 8.0
    elif kind == "zipf":
        skew = -1.5 * torch.log(torch.randperm(E, generator=g).double() + 1).float()
    logits = skew + torch.randn(R, S, E, generator=g)
    return logits.topk(K, dim=-1).indices


def simulate(plan: MoonEPPlan, ids: torch.Tensor, d: int, seed: int) -> None:
    """Dispatch every pair by the plan, compute it on its rank with the weights that rank holds (home experts
    plus fetched copies), combine, and compare with computing every pair at home."""
    R, S, K = ids.shape
    E, T = plan.num_experts, plan.pairs_per_rank
    n = E // R
    g = torch.Generator().manual_seed(seed)
    # Integer-valued fp64: every product and sum is exact, so "identical" is a real equality test.
    W = torch.randint(-3, 4, (E, d, d), generator=g).double()
    x = torch.randint(-3, 4, (R, S, d), generator=g).double()
    reference = torch.einsum("rsi,rskij->rskj", x, W[ids])

    counts = torch.stack([torch.bincount(ids[r].reshape(-1), minlength=E) for r in range(R)])
    assert torch.equal(counts.sum(0), plan.loads)
    base = rank_offsets(counts)
    g_rank, g_row = pair_slots(plan, ids)
    assert torch.equal(pair_destinations(plan, ids), g_rank)

    recv_x = torch.full((R, T, d), float("nan"), dtype=torch.float64)
    recv_e = torch.full((R, T), -1, dtype=torch.int64)
    dest = []
    for r in range(R):  # each rank places its own pairs, knowing only its ids, the plan and its base
        rank, row = pair_slots(plan, ids[r], base[r])
        assert torch.equal(rank, g_rank[r]) and torch.equal(row, g_row[r])
        assert torch.equal(pair_destinations(plan, ids[r], base[r]), rank)
        recv_x[rank.reshape(-1), row.reshape(-1)] = x[r].repeat_interleave(K, 0)
        recv_e[rank.reshape(-1), row.reshape(-1)] = ids[r].reshape(-1)
        dest.append((rank, row))
    # A bijection onto [R] x [T]: every buffer row written exactly once.
    keys = torch.cat([(rk * T + rw).reshape(-1) for rk, rw in dest])
    assert torch.equal(keys.sort().values, torch.arange(R * T))
    for e in range(E):  # pairs per (expert, rank) are the plan's assignment
        for r in range(R):
            assert int((g_rank[ids == e] == r).sum()) == int(plan.assign[e, r])

    out = torch.full((R, T, d), float("nan"), dtype=torch.float64)
    for r in range(R):
        held = {e: W[e] for e in range(r * n, (r + 1) * n)}
        held.update({e: W[e].clone() for e in plan.redundant[r].tolist() if e >= 0})  # prefetched copies
        for e in range(E):
            lo, cnt = int(plan.row_start[e, r]), int(plan.assign[e, r])
            if cnt == 0:
                continue
            assert (recv_e[r, lo:lo + cnt] == e).all()  # expert-grouped buffer
            out[r, lo:lo + cnt] = recv_x[r, lo:lo + cnt] @ held[e]  # KeyError: a pair without the weights
    assert not out.isnan().any()
    got = torch.stack([out[rk, rw] for rk, rw in dest])  # combine: [R, S, K, d]
    assert torch.equal(got, reference)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=st.sampled_from([(4, 2, 1), (8, 2, 2), (12, 3, 3), (16, 4, 4), (32, 8, 4), (24, 8, 1)]),
       S=st.integers(1, 12), kind=st.sampled_from(["uniform", "hot_rank", "zipf", "same_expert"]),
       seed=st.integers(0, 1000))
def test_dispatch_matches_home_computation(shape, S, kind, seed):
    E, R, K = shape
    ids = routed_ids(kind, E, R, S, K, seed)
    loads = torch.bincount(ids.reshape(-1), minlength=E)
    plan = plan_moon_ep(loads, R, S * K)
    check_plan(plan, loads, R, S * K)
    simulate(plan, ids, d=3, seed=seed)


def test_dispatch_at_release_expert_shape():
    E, R, K, S = 896, 64, 16, 8
    ids = routed_ids("zipf", E, R, S, K, 0)
    loads = torch.bincount(ids.reshape(-1), minlength=E)
    plan = plan_moon_ep(loads, R, S * K)
    check_plan(plan, loads, R, S * K)
    g_rank, g_row = pair_slots(plan, ids)
    keys = (g_rank * S * K + g_row).reshape(-1)
    assert torch.equal(keys.sort().values, torch.arange(R * S * K))
    counts = torch.zeros(E, R, dtype=torch.int64)
    counts.index_put_((ids.reshape(-1), g_rank.reshape(-1)), torch.ones(ids.numel(), dtype=torch.int64),
                      accumulate=True)
    assert torch.equal(counts, plan.assign)


# --- validation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loads,R,T,match", [
    (torch.tensor([2, 2, 2]), 2, 3, r"E=3 must be a positive multiple of num_ranks=2"),
    (torch.tensor([1, 1, 1, 1]), 2, 3, r"sum to num_ranks \* tokens_per_rank_pairs = 2 \* 3 = 6, got 4"),
    (torch.tensor([4, -1, 2, 1]), 2, 3, r"non-negative, got loads\[1\] = -1"),
    (torch.tensor([1.5, 1.5, 1.5, 1.5]), 2, 3, r"integer tensor, got dtype torch.float32"),
    (torch.ones(2, 2, dtype=torch.int64), 2, 2, r"1-D \[E\] tensor"),
    (torch.tensor([3, 3]), 0, 3, r"num_ranks must be an int >= 1, got 0"),
    (torch.tensor([3, 3]), True, 3, r"num_ranks must be an int >= 1, got True"),
    (torch.tensor([0, 0]), 2, 0, r"tokens_per_rank_pairs must be an int >= 1, got 0"),
    (torch.tensor([], dtype=torch.int64), 1, 1, r"E=0 must be a positive multiple"),
])
def test_invalid_inputs(loads, R, T, match):
    with pytest.raises(ValueError, match=match):
        plan_moon_ep(loads, R, T)
    with pytest.raises(ValueError, match=match):
        plan_exact(loads, R, T)


def test_invalid_dispatch_inputs():
    plan = plan_moon_ep(torch.tensor([3, 1, 2, 2]), 2, 4)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got min 0 max 4"):
        pair_destinations(plan, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"integer tensor"):
        pair_destinations(plan, torch.tensor([[0.0]]))
    with pytest.raises(ValueError, match=r"expert 1: base 1 \+ 1 routed pairs do not fit the plan's load 1"):
        pair_slots(plan, torch.tensor([[1]]), base=torch.tensor([0, 1, 0, 0]))
    with pytest.raises(ValueError, match=r"base must be a \[E=4\] tensor"):
        pair_slots(plan, torch.tensor([[1]]), base=torch.zeros(3))
    with pytest.raises(ValueError, match=r"counts must be a \[R, E\] tensor"):
        rank_offsets(torch.zeros(4))


def test_plan_exact_limits():
    with pytest.raises(ValueError, match=r"at most 16 experts, got E=18"):
        plan_exact(torch.full((18,), 1), 2, 9)
    loads = integer_loads([0.0] * 3 + [1.0] * 9, 4 * 30)  # E=12, R=4: needs 2 copies on rank 0
    with pytest.raises(ValueError, match=r"more than max_candidates=100 choices"):
        plan_exact(loads, 4, 30, max_candidates=100)
