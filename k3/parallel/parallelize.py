"""One entry point that shards a finished K3 model over a ("dp", "ep", "cp") device mesh for training.

Order matters: expert parallelism first (each rank keeps its ep slice of the routed experts, which FSDP2 then
shards over the ranks that hold the same experts), then FSDP2 over every rank for the dense rest
(k3.parallel.fsdp.apply_fsdp leaves units that are already sharded alone). Every rank must hold the same full
model (same seed or the same checkpoint) when `parallelize` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from k3.parallel.expert_parallel import ExpertParallelExperts, apply_expert_parallel, shard_experts
from k3.parallel.fsdp import apply_fsdp

__all__ = ["ParallelizeOptions", "parallelize", "default_param_dtype"]


@dataclass(frozen=True)
class ParallelizeOptions:
    """`param_dtype`: FSDP2's compute dtype (None: the parameters' own, fp32 runs equal the single-device run;
    bf16: mixed precision with fp32 master weights and fp32 gradient reduction). `moon_ep`: MoonEP's balanced
    expert placement instead of plain EP. `reshard_after_forward`: free the gathered parameters after each
    unit's forward (gathered again in backward) instead of keeping them until the backward."""
    param_dtype: torch.dtype | None = None
    moon_ep: bool = False
    reshard_after_forward: bool = True


def default_param_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 compute on CUDA, the parameters' fp32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else None


def parallelize(model: nn.Module, mesh: DeviceMesh, options: ParallelizeOptions | None = None) -> nn.Module:
    """Shard `model` (a K3ForCausalLM) over `mesh` (dims "dp", "ep", "cp") in place and return it: expert parallel
    over "ep" when it has more than one rank (each expert's parameters sharded over ("dp", "cp"), their gradients
    divided by the world size like the dense ones'), then FSDP2 over the whole mesh."""
    opts = options or ParallelizeOptions()
    if mesh["ep"].size() > 1:
        from k3.parallel.mesh import ParallelDims

        ParallelDims(mesh["dp"].size(), mesh["ep"].size(), mesh["cp"].size()).check_model(model.config.num_experts)
        apply_expert_parallel(model, mesh["ep"], moon_ep=opts.moon_ep)
        expert_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        # FSDP2 averages each expert's gradient over the ("dp", "cp") ranks that hold it; that gradient already sums
        # every EP rank's tokens, so 1 / ep more makes it the gradient of the mean loss over all ranks, as the
        # dense parameters' is (an autograd scale in the expert module: the same on every collective backend).
        for m in model.modules():
            if isinstance(m, ExpertParallelExperts):
                m.grad_scale = 1.0 / mesh["ep"].size()
        shard_experts(model, expert_mesh, param_dtype=opts.param_dtype,
                      reshard_after_forward=opts.reshard_after_forward)
    flat = mesh._flatten("dp_ep_cp")
    return apply_fsdp(model, flat, param_dtype=opts.param_dtype, reshard_after_forward=opts.reshard_after_forward)
