"""The owner split's pure parts (k3.train.sharded_muon): the owner assignment, the shards' rows, the Newton-Schulz
cost. The exchange itself runs in tests/parallel/test_train_distributed.py (forked gloo ranks)."""

import itertools

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3.train.sharded_muon import assign_owners, ns_cost, shard_rows


def loads(costs, owners, world):
    out = [0] * world
    for c, o in zip(costs, owners):
        out[o] += c
    return out


def test_assign_owners_largest_first_onto_least_loaded_lowest_rank_on_ties():
    # by cost: 8 -> 0; 5 -> 1; 3 -> 2; 3 -> 2 (load 3 < 5); 2 -> 1 (5); 1 -> 2 (6); 1 -> 1 (7, tie with 2: lowest rank)
    assert assign_owners([5, 3, 3, 8, 1, 1, 2], 3) == [1, 2, 2, 0, 2, 1, 1]
    assert assign_owners([4, 4, 4, 4], 2) == [0, 1, 0, 1]  # equal costs: by position, alternating
    assert assign_owners([7, 1], 4) == [0, 1]  # fewer items than ranks: the rest own nothing
    assert assign_owners([3, 2, 1], 1) == [0, 0, 0]
    assert assign_owners([0, 0, 0], 2) == [0, 1, 0]  # zero-cost items: by fewest items owned
    assert assign_owners([], 3) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**9), max_size=40), st.integers(1, 9))
@example([0, 0], 2)  # found by hypothesis: zero-cost items all went to rank 0
def test_assign_owners_is_balanced_and_deterministic(costs, world):
    owners = assign_owners(costs, world)
    assert owners == assign_owners(list(costs), world)  # a pure function of (costs, world): every rank agrees
    assert len(owners) == len(costs) and all(0 <= o < world for o in owners)
    load = loads(costs, owners, world)
    # the rank that took the last item onto the final maximum was the least loaded then
    assert max(load) - min(load) <= max(costs, default=0)
    if len(costs) >= world:  # the largest items go to distinct ranks first
        top = sorted(range(len(costs)), key=lambda i: (-costs[i], i))[:world]
        assert sorted(owners[i] for i in top) == list(range(world))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=7), st.integers(2, 3))
def test_assign_owners_within_four_thirds_of_the_optimum(costs, world):
    # Graham's bound for largest-first greedy, against brute force over every assignment
    best = min(max(loads(costs, a, world)) for a in itertools.product(range(world), repeat=len(costs)))
    assert 3 * max(loads(costs, assign_owners(costs, world), world)) <= 4 * best


def test_shard_rows_follow_torch_chunk():
    # DTensor's Shard(0) (FSDP2's layout) splits as torch.chunk: ceil(n / world) rows while they last
    for n in range(0, 13):
        for world in range(1, 6):
            chunks = [c.shape[0] for c in torch.arange(n).chunk(world)] if n else []
            assert shard_rows(n, world) == chunks + [0] * (world - len(chunks)), (n, world)
    assert shard_rows(5, 4) == [2, 2, 1, 0] and shard_rows(2, 3) == [1, 1, 0] and shard_rows(6, 4) == [2, 2, 2, 0]


def test_ns_cost_counts_the_three_gemms_on_the_smaller_gram():
    # a [64, 128] block: Gram 64 x 64 x 128, its square 64^3, the iterate 64 x 64 x 128, per step
    assert ns_cost(1, 64, 128, 1) == 2 * 64 * 64 * 128 + 64 ** 3
    assert ns_cost(3, 128, 64, 5) == 15 * ns_cost(1, 64, 128, 1)  # tall blocks run on the transpose
    assert ns_cost(0, 64, 128, 5) == 0
