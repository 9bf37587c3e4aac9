"""Sharded checkpoints of expert-parallel models (k3.parallel.checkpoint): every expert's rows, and its optimizer
state, are stored at their global expert id, whatever the ep size and the FSDP2 sharding of the saving run.

Four gloo ranks hold a tiny fp32 K3 model with 6 routed experts at --dp-shard 2 x --ep 2 (each ep rank's 3 experts
FSDP2-sharded unevenly over 2 ranks: 2 + 1 rows), give every expert table a Muon momentum that is a function of
its rows, and save. The same four ranks then load that checkpoint into models of another seed at three meshes:
the same one, --ep 2 x --cp 2 (other ranks hold each ep slice) and plain FSDP2 over 4 ranks (--ep 1, the 6 experts
split 2 + 2 + 2 + 0). Every rank's experts, momenta and dense parameters must equal the saved model's exactly (a
load copies bits), and the optimizer's expert groups keep the loading run's E / ep blocks. One process then loads
the checkpoint into a plain model (DCP gathers all ranks' slices) and reads the export of the resharded model:
both equal the saved model bitwise.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import randomize_
from safetensors.torch import save_file

from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.parallel import checkpoint as pc

MESHES = {"dp2-ep2": (2, 2, 1), "ep2-cp2": (1, 2, 2), "dp4": (4, 1, 1)}  # (dp, ep, cp) of the loads


def make_model(seed: int) -> K3ForCausalLM:
    return randomize_(K3ForCausalLM(K3Config.from_preset("tiny").replace(num_experts=6)), seed=seed)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def momentum_of(w: torch.Tensor) -> torch.Tensor:
    """The momentum given to an expert table: a function of its rows, so a row misplaced in either shows."""
    return 2 * w + 1


def sharded(seed: int, dims: tuple[int, int, int]):
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.parallelize import parallelize
    from k3.train.per_head_muon import PerHeadMuon, muon_param_groups

    model = parallelize(make_model(seed), ParallelDims(*dims).build_mesh("cpu"))
    return model, PerHeadMuon(muon_param_groups(model), lr=1e-2)


def expert_tables(model) -> dict:
    """{name: (module, first global expert id held here)} of the routed-expert tables."""
    from k3.model.latent_moe import GroupedExperts
    from k3.parallel.expert_parallel import ExpertParallelExperts

    return {f"{n}.{w}": (m, m.expert_range[0] if isinstance(m, ExpertParallelExperts) else 0)
            for n, m in model.named_modules() if isinstance(m, GroupedExperts) for w in ("w1", "w3", "w2")}


def worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ref = make_model(0).state_dict()
        model, opt = sharded(0, (2, 2, 1))
        pc._train_state(model, opt)  # the optimizer's state (zero momenta) exists from here
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in expert_tables(model):
                buf = opt.state[params[name]]["momentum_buffer"]
                buf.to_local().copy_(momentum_of(params[name].to_local()))
        pc.save_sharded(f"{out}/ck", model, opt, {"step": 7})
        for label, dims in MESHES.items():
            model, opt = sharded(1, dims)
            assert pc.load_sharded(f"{out}/ck", model, opt) == {"step": 7}
            params, tables = dict(model.named_parameters()), expert_tables(model)
            for name, p in params.items():
                got = full(p)
                if name in tables:
                    m, lo = tables[name]
                    want = ref[name][lo:lo + got.shape[0]]
                    assert torch.equal(full(opt.state[p]["momentum_buffer"]), momentum_of(want)), (label, name)
                    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
                    assert group["num_blocks"] == got.shape[0] == 6 // dims[1], (label, name, group["num_blocks"])
                else:
                    want = ref[name]
                assert torch.equal(got, want), (label, rank, name)
            if label == "ep2-cp2":
                pc.export_pretrained(model, f"{out}/export")
        if rank == 0:
            save_file(ref, f"{out}/ref.safetensors")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp-ep")
    mp.start_processes(worker, args=(4, str(out)), nprocs=4, start_method="fork")
    return out


def test_expert_rows_load_at_their_global_ids_at_any_ep_size(run):
    from safetensors.torch import load_file

    import k3

    ref = load_file(run / "ref.safetensors")  # every rank checked its own slices in the worker
    plain = make_model(1)
    assert pc.load_sharded(run / "ck", plain, None) == {"step": 7}
    for name, t in plain.state_dict().items():
        assert torch.equal(t, ref[name]), name
    exported = k3.from_pretrained(run / "export").state_dict()
    assert exported.keys() == ref.keys()
    for name, t in exported.items():
        assert torch.equal(t, ref[name]), name
