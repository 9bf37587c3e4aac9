"""Per-Head Muon (report §2.5) on sharded parameters: each parameter orthogonalized whole by one owner rank.

A sharded Muon parameter is an FSDP2 DTensor with placement Shard(0) on a 1-D mesh of W ranks: mesh coordinate c
holds rows [c * k, min((c + 1) * k, n)) of its n rows, k = ceil(n / W) (torch.chunk; the last coordinates may hold
none). Newton-Schulz needs a head block or an expert matrix whole, so per step and per mesh:

1. ownership: every parameter goes to one owner coordinate (`assign_owners`, balanced by Newton-Schulz cost); every
   rank computes the same assignment from the same ordered parameter list, so nothing is communicated for it;
2. gather: one all-to-all in which every rank sends its rows of each parameter's Newton-Schulz input u to that
   parameter's owner, which stacks them into the whole u (`OwnerExchange.gather`);
3. the owner orthogonalizes its parameters' blocks (batched with its other blocks of the same shape) and
   `put`s the results;
4. scatter: one all-to-all in which every owner sends each rank that rank's rows of the update
   (`OwnerExchange.scatter`), which each rank applies to its shard.

This module only moves rows; what the blocks are and how an update is applied is the optimizer's business
(k3.train.per_head_muon). The all-to-alls are ``all_to_all_single`` with per-rank split sizes over one flat buffer
(gloo's list-form ``all_to_all`` needs equal sizes), in the Newton-Schulz dtype.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["ns_cost", "assign_owners", "shard_rows", "owner_split_applies", "OwnerExchange"]


def ns_cost(num_blocks: int, rows: int, cols: int, steps: int) -> int:
    """Multiply-adds of Newton-Schulz on `num_blocks` [rows, cols] blocks: per step, with m = min(rows, cols) and
    M = max(rows, cols), the Gram matrix (m^2 M), its square (m^3) and the update of the iterate (m^2 M)."""
    m, big = min(rows, cols), max(rows, cols)
    return num_blocks * steps * (2 * m * m * big + m ** 3)


def assign_owners(costs: Sequence[int], world: int) -> list[int]:
    """Owner (0 .. world - 1) of each item: largest cost first (ties by position) onto the least-loaded owner (ties
    by fewest items owned, then lowest index: zero-cost items spread too). Pure and deterministic. Greedy bound: the
    most-loaded owner exceeds the least-loaded one by at most the largest single cost, and carries at most 4/3 of
    the optimal maximum load (Graham's LPT)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    owners = [0] * len(costs)
    loads = [(0, 0, r) for r in range(world)]  # (load, items, rank): a heap ordered by load, items, then rank
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, n, r = heapq.heappop(loads)
        owners[i] = r
        heapq.heappush(loads, (load + costs[i], n + 1, r))
    return owners


def shard_rows(n: int, world: int) -> list[int]:
    """Rows of an n-row tensor held by each of `world` Shard(0) coordinates (torch.chunk: ceil(n / world) rows each
    while they last, so the last coordinates may hold fewer or none)."""
    k = -(-n // world) if n else 0
    return [max(0, min(k, n - c * k)) for c in range(world)]


def owner_split_applies(p: DTensor) -> bool:
    """Whether `p` is sharded the way the owner split handles: Shard(0) on a 1-D mesh (FSDP2's layout)."""
    return p.device_mesh.ndim == 1 and len(p.placements) == 1 and type(p.placements[0]) is Shard \
        and p.placements[0].dim == 0


class OwnerExchange:
    """One step's owner split of the sharded parameters of one 1-D mesh: `add` every parameter (in the same order
    on every rank), `gather` the whole inputs of the owned ones, `put` each owned parameter's update, `scatter`.

    Items are opaque payloads (the optimizer's parameter and group) with this rank's rows u of a tensor of global
    `shape`, all of one dtype and device; their costs decide the owners. Buffers: the gather's hold this rank's
    shards and the whole inputs it owns, the scatter's the updates it owns and its shards of the rest."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.me = mesh.get_local_rank()
        ranks = mesh.mesh.flatten().tolist()
        # all_to_all_single orders its splits by rank in the process group; the shards go by mesh coordinate
        self.order = sorted(range(self.world), key=lambda c: dist.get_group_rank(self.group, ranks[c]))
        self.payloads, self.shapes, self.inputs, self.costs = [], [], [], []

    def add(self, payload, u: torch.Tensor, shape: torch.Size, cost: int) -> None:
        if not self.inputs:
            self.empty = u.new_empty(0)  # the dtype and device of the exchange's buffers
        self.payloads.append(payload)
        self.shapes.append(torch.Size(shape))
        self.inputs.append(u)
        self.costs.append(cost)

    def gather(self) -> list[tuple[object, torch.Tensor]]:
        """(payload, whole u of its `shape`) of every item this rank owns, in `add` order (one all-to-all)."""
        self.owners = assign_owners(self.costs, self.world)
        self.rows = [shard_rows(s[0], self.world) for s in self.shapes]
        self.owned = [[j for j, o in enumerate(self.owners) if o == c] for c in range(self.world)]
        mine = self.owned[self.me]
        send = [self.inputs[j].reshape(-1) for c in self.order for j in self.owned[c]]
        recv = self._all_to_all(torch.cat(send),
                                [sum(self.inputs[j].numel() for j in self.owned[c]) for c in self.order],
                                [sum(self._numel(j, c) for j in mine) for c in self.order])
        pieces = {j: [None] * self.world for j in mine}
        for c, flat in recv.items():  # what coordinate c sent: its rows of each item this rank owns
            for j, t in zip(mine, flat.split([self._numel(j, c) for j in mine])):
                pieces[j][c] = t.view(self.rows[j][c], *self.shapes[j][1:])
        # The scatter's send buffer, filled by `put`: for each peer (group order), its rows of each owned item
        self.back = self.empty.new_empty(sum(self._numel(j, c) for c in range(self.world) for j in mine))
        self.back_at, off = {}, 0
        for c in self.order:
            for j in mine:
                self.back_at[j, c] = off
                off += self._numel(j, c)
        self.inputs, self.put_done = None, set()
        return [(self.payloads[j], torch.cat(pieces[j])) for j in mine]

    def put(self, index: int, o: torch.Tensor) -> None:
        """The update of the `index`-th owned item (its position in `gather`'s list): any strides, the item's numel.
        Copied into the scatter's buffer at once, so `o` may be freed."""
        j = self.owned[self.me][index]
        o = o.reshape(self.shapes[j])
        start = 0
        for c, n in enumerate(self.rows[j]):
            at = self.back_at[j, c]
            self.back[at:at + self._numel(j, c)].view(n, *self.shapes[j][1:]).copy_(o[start:start + n])
            start += n
        self.put_done.add(j)

    def scatter(self) -> list[tuple[object, torch.Tensor]]:
        """(payload, this rank's rows of its update) of every item, in `add` order (one all-to-all)."""
        mine = self.owned[self.me]
        if sorted(self.put_done) != mine:
            raise RuntimeError(f"scatter before every owned update was put: have {sorted(self.put_done)}, own {mine}")
        recv = self._all_to_all(self.back, [sum(self._numel(j, c) for j in mine) for c in self.order],
                                [sum(self._numel(j, self.me) for j in self.owned[c]) for c in self.order])
        self.back = None
        out = {}
        for c, flat in recv.items():  # what owner c sent: this rank's rows of each item it owns
            for j, t in zip(self.owned[c], flat.split([self._numel(j, self.me) for j in self.owned[c]])):
                out[j] = t.view(self.rows[j][self.me], *self.shapes[j][1:])
        return [(self.payloads[j], out[j]) for j in range(len(self.payloads))]

    def _numel(self, j: int, c: int) -> int:
        """Elements of item j held by coordinate c."""
        return self.rows[j][c] * math.prod(self.shapes[j][1:])

    def _all_to_all(self, flat: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> dict[int, torch.Tensor]:
        """Send `flat` (`send_sizes` elements to each peer, in group order); returns, by mesh coordinate, what each
        peer sent this rank (`recv_sizes` elements per peer, in group order)."""
        if self.world == 1:
            out = flat
        else:
            out = flat.new_empty(sum(recv_sizes))
            dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=self.group)
        return dict(zip(self.order, out.split(recv_sizes)))
