"""The device mesh of a distributed run: data-parallel shard x expert-parallel x context-parallel ranks.

`ParallelDims` is plain data (the `--dp-shard`, `--ep`, `--cp` flags); `build_mesh` turns it into a
`torch.distributed.device_mesh.DeviceMesh` with dimensions named ("dp", "ep", "cp"), in that order, so that the
ranks of one context-parallel group are neighbours (their all-gathers stay inside a host first).

Roles of the dimensions:
* every rank of a ("dp", "ep") pair reads its own slice of the global batch; the "cp" ranks of one pair split
  each packed row of that slice into contiguous segments (report §5.1.2);
* dense parameters are sharded (FSDP2) over all ranks, and their gradients averaged over all of them;
* routed experts are split over "ep" (expert e lives on ep rank e // (E / ep)), and each expert's parameters
  are sharded over ("dp", "cp").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "ep", "cp")


@dataclass(frozen=True)
class ParallelDims:
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1

    @classmethod
    def from_flags(cls, world_size: int, dp_shard: int | None = None, ep: int = 1, cp: int = 1) -> "ParallelDims":
        """The flags' sizes; `dp_shard=None` fills data parallel (world_size / (ep * cp)). Raises ValueError naming
        the flag when the sizes do not multiply to the world size."""
        for name, v in (("--ep", ep), ("--cp", cp)) + ((("--dp-shard", dp_shard),) if dp_shard is not None else ()):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if dp_shard is None:
            if world_size % (ep * cp):
                raise ValueError(f"--ep {ep} x --cp {cp} = {ep * cp} does not divide the world size {world_size}")
            dp_shard = world_size // (ep * cp)
        dims = cls(dp_shard, ep, cp)
        dims.check(world_size)
        return dims

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.ep * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks that read distinct data: dp_shard x ep (the cp ranks of one of them share its rows)."""
        return self.dp_shard * self.ep

    def check(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"--dp-shard {self.dp_shard} x --ep {self.ep} x --cp {self.cp} = {self.world_size} "
                             f"ranks, but the run has {world_size} (the product must equal the world size)")

    def check_model(self, num_experts: int) -> None:
        """Expert parallelism needs the routed experts to split evenly over the ep ranks."""
        if self.ep > 1 and (num_experts == 0 or num_experts % self.ep):
            raise ValueError(f"--ep {self.ep} needs a number of routed experts divisible by it; the model has "
                             f"{num_experts}")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp_shard, self.ep, self.cp), mesh_dim_names=MESH_DIMS)


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index among the data ranks, their number): which slice of the global batch it reads."""
    dp, ep = mesh["dp"].get_local_rank(), mesh["ep"].get_local_rank()
    return dp * mesh["ep"].size() + ep, mesh["dp"].size() * mesh["ep"].size()


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"
