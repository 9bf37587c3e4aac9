"""Training on several ranks (gloo on CPU): Per-Head Muon on FSDP2-sharded parameters, and the trainer under
torch.distributed (FSDP2, FSDP2 + expert parallel, context parallel, all three) against the single-process run.

fp32 throughout: the sharded runs differ from the single-process one only in summation order (gradient
reduce-scatter, gathered Newton-Schulz inputs), so parameters and losses agree to a few fp32 ulps per step;
1e-5 relative leaves room for that over a few steps and is far below what a wrong shard, offset or gradient
weighting would give. Expert and context parallelism compute in another order (grouped GEMMs over both ranks'
tokens; KCP, attention over gathered rows), which AdamW enlarges on elements with near-zero gradients: their
tests state what that costs.
"""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import rel_err

from k3.config import K3Config
from k3.model.model import K3ForCausalLM

TOL = 1e-5


def init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def tiny_model(seed: int = 0, mtp: bool = True) -> K3ForCausalLM:
    cfg = K3Config.from_preset("tiny").replace(vocab_size=256)
    if not mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
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


# ---------------------------------------------------------------------------------------------------------
# The trainer under torch.distributed
# ---------------------------------------------------------------------------------------------------------
STEPS, SEQ, ROWS = 5, 32, 4  # global batch of 4 rows; 2 data ranks of 2 rows each
# QK-Clip's threshold under context parallelism: below the tiny model's largest MLA logits (about 0.1 at
# initialization), so that some heads are clipped at every step and the clip's rescaling is part of what must agree
CLIP_TAU = 0.09


def train_setup(cp: int = 1, quarters: bool = False):
    import numpy as np

    from k3.data.packing import PackedLoader
    from k3.train.trainer import TrainConfig

    stream = np.random.default_rng(0).integers(1, 256, 40 * SEQ).astype(np.int64)
    loader = PackedLoader(stream, SEQ, ROWS, eos_id=0, seed=0)
    # micro-batches of the per-rank rows: the single-process gradient weights each half as the ranks do
    tcfg = TrainConfig(max_steps=STEPS, seq_len=SEQ, batch_tokens=ROWS * SEQ, micro_batch_rows=ROWS // 2,
                       eval_every=10**6, lr=1e-2)
    if quarters:  # four data ranks: micro-batches of a quarter of the rows
        tcfg.micro_batch_rows = ROWS // 4
    model = tiny_model()
    if cp > 1:  # one row per forward, split over the cp ranks; the MTP layer, and QK-Clip that clips
        tcfg.micro_batch_rows, tcfg.qk_clip_tau = 1, CLIP_TAU
        # Router biases as after a first balancing step instead of zeros: with zero biases every token's (k+1)-th
        # margin is exactly 0, a bin edge of Quantile Balancing's histogram, so fp32 rounding of the scores (which
        # differs between the split and the whole row) picks the bin of each one by chance
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=gen) * 1e-2)
    return model, loader, tcfg


def step_record(m) -> dict:
    """What the tests compare of a step's metrics."""
    return {"loss": m.loss, "mtp_loss": m.mtp_loss, "max_logit": m.max_logit, "clipped_heads": m.clipped_heads}


def trainer_worker(rank: int, world: int, store: str, ep: int, out: str, cp: int = 1, quarters: bool = False) -> None:
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.parallelize import ParallelizeOptions, parallelize
    from k3.train.distributed import DistributedTrainer

    init(rank, world, store)
    try:
        model, loader, tcfg = train_setup(cp, quarters)
        tcfg.out = out
        mesh = ParallelDims.from_flags(world, None, ep=ep, cp=cp).build_mesh("cpu")
        parallelize(model, mesh, ParallelizeOptions())
        trainer = DistributedTrainer(model, tcfg, loader, mesh)
        if cp > 1:  # the first batch's gradients, as the optimizer would see them
            grads = first_gradients(trainer)
            if rank == 0:
                os.makedirs(out, exist_ok=True)
                torch.save(grads, f"{out}/grads.pt")
        steps = [step_record(trainer.train_step()) for _ in range(STEPS)]
        trainer.save()
        if rank == 0:
            torch.save(steps, f"{out}/steps.pt")
    finally:
        dist.destroy_process_group()


def first_gradients(trainer) -> dict[str, torch.Tensor]:
    """The gradients of the trainer's first batch (forward and backward of every micro-batch, then the reduction),
    full tensors by parameter name; the parameters, the loader and the gradients are left as they were."""
    state = trainer.loader.state_dict()
    batch = trainer._next_batch()
    bias = [m.gate.e_score_correction_bias.clone() for m in trainer.moe_layers]
    trainer._accumulate(batch, trainer.cfg.micro_batch_rows or batch["input_ids"].shape[0], bias)
    trainer._all_reduce_grads()
    grads = {n: full(p.grad).detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    for bal in trainer.balancers:
        bal.discard()
    if trainer.max_logits is not None:
        trainer.max_logits.discard()
    trainer.loader.load_state_dict(state)
    return grads


def single_process_run(cp: int = 1, quarters: bool = False) -> tuple[list[dict], K3ForCausalLM, dict | None]:
    """(every step's record, the trained model, the first batch's gradients under cp > 1)."""
    from k3.train.trainer import Trainer

    model, loader, tcfg = train_setup(cp, quarters)
    trainer = Trainer(model, tcfg, loader)
    grads = first_gradients(trainer) if cp > 1 else None
    return [step_record(trainer.train_step()) for _ in range(STEPS)], model, grads


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return single_process_run()


@pytest.fixture(scope="module")
def cp_reference():
    """The single-process run of the context-parallel tests: one row per forward, with MTP and clipping QK-Clip."""
    torch.set_num_threads(1)
    return single_process_run(cp=2)


def assert_steps_match(out: str, ref_steps: list[dict], max_logit_tol: float = TOL) -> None:
    """Every step's loss and MTP loss within TOL (relative), its largest MLA logit within `max_logit_tol`, and the
    same number of heads clipped by QK-Clip."""
    steps = torch.load(f"{out}/steps.pt")
    for s, (a, b) in enumerate(zip(steps, ref_steps), start=1):
        for key, tol in (("loss", TOL), ("mtp_loss", TOL), ("max_logit", max_logit_tol)):
            if b[key] is not None:
                assert abs(a[key] - b[key]) <= tol * abs(b[key]), f"step {s}: {key} {a[key]} vs single-process {b[key]}"
        assert a["clipped_heads"] == b["clipped_heads"], f"step {s}: {a['clipped_heads']} heads clipped vs {b}"


def param_errors(out: str, ref_model: K3ForCausalLM) -> dict[str, float]:
    """Every parameter's error (relative to its largest entry) in the run's last gathered checkpoint, as `k3 eval`
    loads it, against the single-process model."""
    from k3.checkpoint import from_pretrained
    from k3.train.checkpointing import checkpoint_path

    got = from_pretrained(checkpoint_path(out, STEPS))
    ref_sd = ref_model.state_dict()
    return {n: rel_err(t.float(), ref_sd[n].float()) for n, t in got.state_dict().items()}


def assert_params_match(out: str, ref_model: K3ForCausalLM, tol) -> None:
    """Every parameter and buffer within `tol` (a number, or name -> number) of the single-process run's."""
    tol_of = tol if callable(tol) else (lambda name: tol)
    for n, err in param_errors(out, ref_model).items():
        assert err <= tol_of(n), f"{n} differs from the single-process run by {err:.2e} (> {tol_of(n):.0e})"


@pytest.mark.parametrize("ep", [1, 2], ids=["fsdp", "fsdp+ep2"])
def test_trainer_matches_single_process(tmp_path, reference, ep):
    out = str(tmp_path / "run")
    mp.start_processes(trainer_worker, args=(2, str(tmp_path / "store"), ep, out), nprocs=2, start_method="fork")
    ref_steps, ref_model, _ = reference
    assert_steps_match(out, ref_steps)
    # FSDP alone sums the same two halves as the single process's two micro-batches: 1e-5. With EP an expert's
    # grouped GEMMs run over both ranks' tokens at once (another fp32 summation order; its gradients agree to a
    # few 1e-7), and the first AdamW steps (g / sqrt(g^2)) and Newton-Schulz enlarge such differences on
    # near-zero gradient entries to a few 1e-5 after 5 steps; losses still agree to 1e-5.
    assert_params_match(out, ref_model, TOL if ep == 1 else 1e-4)


def test_trainer_on_two_fsdp_groups_of_two_expert_ranks_matches_single_process(tmp_path):
    # 4 ranks, --dp-shard 2 x --ep 2: each expert sharded over the 2 dp ranks of its ep rank, its gradient summing
    # both ep ranks' tokens and averaged over dp (the 1 / ep scale makes it the mean over all 4 ranks). The 4 data
    # ranks take a quarter of the rows each, as the single process's 4 micro-batches do.
    torch.set_num_threads(1)
    ref_steps, ref_model, _ = single_process_run(quarters=True)
    out = str(tmp_path / "run")
    mp.start_processes(trainer_worker, args=(4, str(tmp_path / "store"), 2, out, 1, True), nprocs=4,
                       start_method="fork")
    assert_steps_match(out, ref_steps)
    assert_params_match(out, ref_model, 1e-4)  # as for --ep 2 on 2 ranks (see test_trainer_matches_single_process)


def context_parallel_tolerance(ref_model: K3ForCausalLM):
    """Parameter name -> tolerance after the 5 context-parallel steps, by optimizer.

    The split run differs from the whole-row one by fp32 summation order (KCP's prefix composition, attention over
    the gathered rows, the cut's MTP rows): losses by < 1e-6, the first gradients by < 1e-4 of each tensor's
    largest entry (test_context_parallel.py). Muon orthogonalizes whole blocks, so its updates keep that precision:
    1e-4 (observed 2.4e-5). AdamW's update of an element is m / (sqrt(v) + eps), blind to the gradient's size: an
    element whose first gradient is of the order of eps = 1e-8 (an embedding row of a token first met where it
    barely matters; a zero-initialized AttnRes pseudo-query) moves by a fraction of the learning rate set by
    rounding at the 1e-7 level, and after 5 steps at lr 1e-2 such elements differ by up to ~1e-2 of the tensor's
    largest entry (observed 1.3e-2 for the embedding, 2.5e-4 for the output head, 1.1e-4 for the pseudo-queries).
    AdamW parameters get 3e-2; a wrong gradient moves whole rows by O(lr), and the gradients themselves are checked
    to 1e-4 first. Router biases (Quantile Balancing, whose histogram counts add over the ranks): 1e-4."""
    from k3.train.per_head_muon import describe_param_groups

    kinds = describe_param_groups(ref_model)
    return lambda name: 3e-2 if kinds.get(name, "").startswith("adamw") else 1e-4


def check_context_parallel_run(out: str, cp_reference) -> None:
    """A context-parallel run (MTP layer, QK-Clip clipping at every step) against the single process."""
    ref_steps, ref_model, ref_grads = cp_reference
    assert all(s["clipped_heads"] > 0 for s in ref_steps), "CLIP_TAU must make QK-Clip clip at every step"
    # The gradients of the first batch: the scale of the cp ranks' shares and the averaging over ranks must give
    # exactly the single-process gradient (Muon and Adam are nearly blind to a wrong overall scale, so the losses
    # alone would not show one). 1e-4 of each tensor's largest entry: KCP's order of summation (5e-5 on the KDA
    # inputs, test_context_parallel.py), and the MTP block's zero-initialized AttnRes pseudo-query, whose gradient
    # sums nearly cancelling terms (observed 6e-5; every other tensor < 2e-5).
    grads = torch.load(f"{out}/grads.pt")
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        want = ref_grads[n][:g.shape[0]]  # under --ep, rank 0's routed experts are the first E / ep
        err = rel_err(g, want)
        assert err <= 1e-4, f"gradient of {n} differs from the single-process one by {err:.2e}"
    # Losses and MTP losses within 1e-5 at every step (observed < 5e-7), the same number of heads clipped. The
    # largest logit is computed exactly (the same queries against the same keys; test_model_context_parallel.py
    # checks it to 1e-5 on the same weights); from the trained weights, whose AdamW elements drift as
    # context_parallel_tolerance says, it agrees to 1e-4 (observed 2.1e-5 at step 5, 3.4e-7 at step 1).
    assert_steps_match(out, ref_steps, max_logit_tol=1e-4)
    assert_params_match(out, ref_model, context_parallel_tolerance(ref_model))


def test_trainer_with_context_parallel_matches_single_process(tmp_path, cp_reference):
    # --cp 2 on 2 ranks: every packed row is split in two along the sequence (KDA state through KCP's all-gather,
    # MLA over the gathered latent rows, the short conv's carried inputs, the MTP layer's next tokens at the cut,
    # QK-Clip's maxima over both ranks' queries), against one process taking the same rows one per forward.
    out = str(tmp_path / "run")
    mp.start_processes(trainer_worker, args=(2, str(tmp_path / "store"), 1, out, 2), nprocs=2, start_method="fork")
    check_context_parallel_run(out, cp_reference)


def test_trainer_fsdp_ep_cp_on_four_ranks_matches_single_process(tmp_path, cp_reference):
    # 4 ranks, --dp-shard 1 x --ep 2 x --cp 2: dense parameters FSDP2-sharded over all 4 ranks; the routed experts
    # split over the 2 ep ranks and each sharded over its 2 cp ranks (its gradient summing both ep ranks' tokens,
    # the 1 / ep scale and the average over cp making it the single process's). The 2 data (ep) ranks read 2 rows
    # each, every row split over their cp pair; the single process takes the same 4 rows one per forward.
    out = str(tmp_path / "run")
    mp.start_processes(trainer_worker, args=(4, str(tmp_path / "store"), 2, out, 2), nprocs=4, start_method="fork")
    check_context_parallel_run(out, cp_reference)


# ---------------------------------------------------------------------------------------------------------
# Resume from the sharded checkpoint, at the same and at another world size
# ---------------------------------------------------------------------------------------------------------
FIRST = 3  # steps before the save; the resumed run trains the remaining STEPS - FIRST


def resume_worker(rank: int, world: int, store: str, out: str, resume: bool) -> None:
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.parallelize import ParallelizeOptions, parallelize
    from k3.run_dir import latest_checkpoint
    from k3.train.distributed import DistributedTrainer

    init(rank, world, store)
    try:
        model, loader, tcfg = train_setup()
        tcfg.out = out
        if resume:
            torch.manual_seed(123)  # the resumed run's own seed: the checkpoint's RNG state replaces it
            model = tiny_model(seed=7)  # other initial weights: the checkpoint's replace them
        mesh = ParallelDims.from_flags(world, None).build_mesh("cpu")
        parallelize(model, mesh, ParallelizeOptions())
        trainer = DistributedTrainer(model, tcfg, loader, mesh)
        if resume:
            trainer.load(latest_checkpoint(out))
            assert trainer.step == FIRST and trainer._saved_step == FIRST
        losses = [trainer.train_step().loss for _ in range(STEPS - FIRST if resume else FIRST)]
        trainer.save()
        if rank == 0:
            torch.save(losses, f"{out}/losses-{'resumed' if resume else 'first'}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 1], ids=["2to2", "2to1"])
def test_resume_from_sharded_checkpoint(tmp_path, reference, world):
    from k3.checkpoint import from_pretrained
    from k3.run_dir import latest_checkpoint, sharded_state
    from k3.train.checkpointing import checkpoint_path

    out = str(tmp_path / "run")
    mp.start_processes(resume_worker, args=(2, str(tmp_path / "store1"), out, False), nprocs=2, start_method="fork")
    first = checkpoint_path(out, FIRST)
    assert latest_checkpoint(out) == first and sharded_state(first) is not None
    assert not any(n.endswith(".sharded") for n in __import__("os").listdir(f"{out}/checkpoints"))
    mp.start_processes(resume_worker, args=(world, str(tmp_path / "store2"), out, True), nprocs=world,
                       start_method="fork")
    assert latest_checkpoint(out) == checkpoint_path(out, STEPS)
    # The resumed run continues exactly the uninterrupted one (same weights, momenta, data position, schedule),
    # so it matches the single-process run as closely as the uninterrupted distributed run does (1e-5: the
    # ranks' summation order only; at world 1 the two micro-batches are the single process's own).
    ref_steps, ref_model, _ = reference
    ref_losses = [r["loss"] for r in ref_steps]
    losses = torch.load(f"{out}/losses-first.pt") + torch.load(f"{out}/losses-resumed.pt")
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= TOL * abs(b), f"step {s + 1}: loss {a} vs single-process {b}"
    got = from_pretrained(checkpoint_path(out, STEPS))
    ref_sd = ref_model.state_dict()
    for n, t in got.state_dict().items():
        err = rel_err(t.float(), ref_sd[n].float())
        assert err <= TOL, f"{n} differs from the single-process run by {err:.2e}"
