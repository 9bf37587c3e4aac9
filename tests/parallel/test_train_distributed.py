"""Training on several ranks (gloo on CPU): Per-Head Muon on FSDP2-sharded parameters, and the trainer under
torch.distributed (FSDP2, FSDP2 + expert parallel) against the single-process run.

fp32 throughout: the sharded runs differ from the single-process one only in summation order (gradient
reduce-scatter, gathered Newton-Schulz inputs), so parameters and losses agree to a few fp32 ulps per step;
1e-5 relative leaves room for that over a few steps and is far below what a wrong shard, offset or gradient
weighting would give.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import rel_err

from k3.config import K3Config
from k3.model.model import K3ForCausalLM

TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def tiny_model(seed: int = 0) -> K3ForCausalLM:
    cfg = K3Config.from_preset("tiny").replace(vocab_size=256)
    return K3ForCausalLM(cfg).init_weights(seed=seed)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------------------
# Per-Head Muon on DTensor parameters
# ---------------------------------------------------------------------------------------------------------
def muon_worker(rank: int, world: int, store: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from k3.parallel.fsdp import apply_fsdp
    from k3.train.per_head_muon import PerHeadMuon, muon_param_groups

    init(rank, world, store)
    try:
        ref = tiny_model()
        model = copy.deepcopy(ref)
        names = [n for n, _ in ref.named_parameters()]
        gen = torch.Generator().manual_seed(1)
        grads = [[torch.randn(p.shape, generator=gen) for p in ref.parameters()] for _ in range(2)]
        opt_ref = PerHeadMuon(muon_param_groups(ref), lr=1e-2)
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        opt = PerHeadMuon(muon_param_groups(model), lr=1e-2)
        assert [n for n, _ in model.named_parameters()] == names
        for step_grads in grads:  # two steps: the second one reads the momentum
            for p, g in zip(ref.parameters(), step_grads):
                p.grad = g.clone()
            for p, g in zip(model.parameters(), step_grads):
                p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements)
            opt_ref.step()
            opt.step()
        for n, p, q in zip(names, model.parameters(), ref.parameters()):
            err = rel_err(full(p.detach()), q.detach())
            assert err <= TOL, f"rank {rank}: {n} differs from the single-device step by {err:.2e}"
    finally:
        dist.destroy_process_group()


def test_per_head_muon_on_fsdp_shards(tmp_path):
    mp.start_processes(muon_worker, args=(2, str(tmp_path / "store")), nprocs=2, start_method="fork")
