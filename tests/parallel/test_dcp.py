"""Sharded checkpoints (k3.parallel.checkpoint) in gloo process groups, on a tiny fp32 K3 model with MTP under FSDP2.

(a) Four ranks train STEPS steps, save a sharded checkpoint (model + AdamW state + extra) and train MORE steps;
two ranks resume from that checkpoint (into a model built from another seed) and train the same MORE steps: the
weights equal the four ranks'. A single process training on the whole global batch, saving with the trainer's
unsharded checkpoint (k3.train.checkpointing) and resuming from it, ends at the same weights too. (b) A model
sharded over two ranks and exported with export_pretrained is bitwise the unsharded model, and k3.from_pretrained
loads it. (c) A save interrupted before the rename (only `<path>.partial` on disk), a checkpoint missing a data file
or its DCP metadata, and an official-layout directory are refused with errors naming the path.

Schedule: the global batch of step s is fixed (ROWS rows of seed s); rank r of R takes rows [r ROWS/R, (r+1) ROWS/R).
Every row has the same number of tokens, so the ranks' mean losses average to the global mean loss and FSDP's
gradient average is the single-process gradient.

Tolerance: everything is fp32 and the runs compute the same sums in another grouping (a rank's rows, then the
reduce-scatter over 4, 2 or no ranks), so gradients differ by fp32 rounding. Adam would amplify that: its update
g / (sqrt(v) + eps) is lr * sign(g) on the first step, so an entry whose gradient is rounding noise around zero
moves by +-lr depending on the run. With eps (1e-2) above such gradients the update's slope in g is at most
lr / eps, the rounding stays rounding, and after the few steps here (each adds a little through the attention and
the routing) the weights agree within 1e-5 of each tensor's largest entry while having moved by far more.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import randomize_, rel_err
from safetensors.torch import load_file, save_file

from k3.checkpoint import CheckpointError
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.parallel import checkpoint as pc

TOL = 1e-5
STEPS, MORE = 1, 2  # steps before the save, steps after it
ROWS, T = 4, 16  # global batch: rows x tokens


def cfg() -> K3Config:
    return K3Config.from_preset("tiny")  # fp32, one MTP layer


def make_model(seed: int) -> K3ForCausalLM:
    return randomize_(K3ForCausalLM(cfg()), seed=seed)


def make_optimizer(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-2, weight_decay=0.1)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(1, cfg().vocab_size, (ROWS, T), generator=torch.Generator().manual_seed(100 + step))


def train(model, opt, steps: range, rank: int = 0, world: int = 1) -> None:
    n = ROWS // world
    for s in steps:
        ids = global_batch(s)[rank * n:(rank + 1) * n]
        out = model(ids, labels=ids)
        (out.loss + 0.3 * out.mtp_loss).backward()  # each a mean over this rank's tokens
        opt.step()
        opt.zero_grad(set_to_none=True)


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.contiguous() for k, v in sd.items()}


def worker(rank: int, world: int, phase: str, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store-{phase}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from k3.parallel.fsdp import apply_fsdp

        mesh = init_device_mesh("cpu", (world,))
        if phase == "save":
            model = apply_fsdp(make_model(0), mesh)
            opt = make_optimizer(model)
            train(model, opt, range(STEPS), rank, world)
            pc.save_sharded(f"{out}/ck", model, opt, {"step": STEPS, "rows": STEPS * ROWS, "note": [1.5, None]})
            train(model, opt, range(STEPS, STEPS + MORE), rank, world)
        else:
            model = apply_fsdp(make_model(1), mesh)  # another init: everything must come from the checkpoint
            pc.export_pretrained(model, f"{out}/export")
            opt = make_optimizer(model)
            extra = pc.load_sharded(f"{out}/ck", model, opt)
            if rank == 0:
                with open(f"{out}/extra.json", "w") as f:
                    json.dump(extra, f)
            train(model, opt, range(extra["step"], extra["step"] + MORE), rank, world)
        sd = full_state(model)
        if rank == 0:
            save_file(sd, f"{out}/{phase}.safetensors")
    finally:
        dist.destroy_process_group()


def single_process(tmp) -> dict[str, torch.Tensor]:
    """STEPS steps on the whole batch, the trainer's unsharded checkpoint, a fresh model and optimizer resumed
    from it, MORE steps."""
    from k3.train import state
    from k3.train.checkpointing import checkpoint_path, load_checkpoint, save_checkpoint

    model = make_model(0)
    opt = make_optimizer(model)
    train(model, opt, range(STEPS))
    save_checkpoint(model, str(tmp), STEPS, state.dumps(opt.state_dict()), None, keep=1, log=lambda _: None)
    model = make_model(1)
    opt = make_optimizer(model)
    opt.load_state_dict(state.loads(*load_checkpoint(model, checkpoint_path(str(tmp), STEPS))))
    train(model, opt, range(STEPS, STEPS + MORE))
    return model.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    # fork: the children inherit the imported modules (a spawned interpreter re-imports torch, seconds each)
    mp.start_processes(worker, args=(4, "save", str(out)), nprocs=4, start_method="fork")
    mp.start_processes(worker, args=(2, "resume", str(out)), nprocs=2, start_method="fork")
    return out


def assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].shape == w.shape and rel_err(got[name], w) <= TOL, (name, rel_err(got[name], w))


def test_resume_on_two_ranks_continues_the_four_rank_run(runs):
    four, two = load_file(runs / "save.safetensors"), load_file(runs / "resume.safetensors")
    with open(runs / "extra.json") as f:
        assert json.load(f) == {"step": STEPS, "rows": STEPS * ROWS, "note": [1.5, None]}
    assert_close(two, four)
    # and the continuation did move the weights away from the saved ones (read here in one process)
    saved = make_model(1)
    pc.load_sharded(runs / "ck", saved, None)
    moved = [n for n, t in saved.state_dict().items() if rel_err(four[n], t) > 10 * TOL]
    assert len(moved) > len(four) // 2


def test_sharded_runs_equal_a_single_process_resumed_from_an_unsharded_checkpoint(runs, tmp_path):
    four = load_file(runs / "save.safetensors")
    one = single_process(tmp_path)
    assert_close(four, one)


def test_export_from_two_ranks_is_the_unsharded_model(runs):
    import k3

    want = make_model(1).state_dict()
    got = k3.from_pretrained(runs / "export").state_dict()
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name


def test_unfinished_or_broken_checkpoints_are_refused(runs, tmp_path, monkeypatch):
    model = make_model(1)
    opt = make_optimizer(model)
    # a save interrupted before the rename (a rank died, or rank 0 before publishing): only `.partial` exists
    monkeypatch.setattr(pc, "replace_dir", lambda tmp, path: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):
        pc.save_sharded(tmp_path / "cut", model, opt, {"step": 1})
    monkeypatch.undo()
    assert not (tmp_path / "cut").exists() and (tmp_path / "cut.partial").is_dir()
    with pytest.raises(CheckpointError, match=r"cut\.partial exists: its save was never completed"):
        pc.load_sharded(tmp_path / "cut", model, opt)
    with pytest.raises(CheckpointError, match=r"cut\.partial is an unfinished save"):
        pc.load_sharded(tmp_path / "cut.partial", model, opt)
    # the four ranks' checkpoint, renamed back to its `.partial` name, is refused as well
    shutil.copytree(runs / "ck", tmp_path / "ck4.partial")
    with pytest.raises(CheckpointError, match="never completed"):
        pc.load_sharded(tmp_path / "ck4", model, opt)
    assert not pc.is_sharded_checkpoint(tmp_path / "ck4.partial")
    # a missing data file, missing DCP metadata, the official layout: each named
    broken = tmp_path / "broken"
    shutil.copytree(runs / "ck", broken)
    assert pc.is_sharded_checkpoint(broken)
    os.unlink(broken / "__3_0.distcp")
    with pytest.raises(CheckpointError, match=r"incomplete: .*__3_0\.distcp is missing"):
        pc.load_sharded(broken, model, opt)
    os.unlink(broken / ".metadata")
    with pytest.raises(CheckpointError, match=r"not a sharded \(DCP\) checkpoint: .*\.metadata is missing"):
        pc.load_sharded(broken, model, opt)
    with pytest.raises(CheckpointError, match="official layout"):
        pc.load_sharded(runs / "export", model, opt)
    # the intact checkpoint loads in one process too (DCP gathers the four ranks' shards)
    assert pc.load_sharded(runs / "ck", model, opt)["step"] == STEPS
