"""Training on several ranks (gloo on CPU): Per-Head Muon on FSDP2-sharded parameters, and the trainer under
torch.distributed (FSDP2, FSDP2 + expert parallel, context parallel, all three) against the single-process run;
resume from the sharded checkpoint, of an expert-parallel run too (at the same mesh, on more ranks, at another
--ep), against the uninterrupted run.

fp32 throughout: the sharded runs differ from the single-process one only in summation order (gradient
reduce-scatter; Per-Head Muon's owner split is exact, see MUON_TOL), so parameters and losses agree to a few fp32
ulps per step; 1e-5 relative leaves room for that over a few steps and is far below what a wrong shard, offset or
gradient weighting would give. Expert and context parallelism compute in another order (grouped GEMMs over both
ranks' tokens; KCP, attention over gathered rows), which AdamW enlarges on elements with near-zero gradients:
their tests state what that costs.
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
# The owner split (k3.train.sharded_muon) gives each sharded parameter's Newton-Schulz the same fp32 inputs as the
# single-device step (momentum and u are elementwise on the shards, the whole u is reassembled exactly) and applies
# the same elementwise update to each shard. Only the batches differ (a rank's buckets hold its own blocks only), and
# CPU bmm computes each matrix of a batch on its own, so the parameters are bitwise equal: MUON_TOL = 0 (relative).
MUON_TOL = 0.0
MUON_STEPS = 3  # the second and third steps read the momentum


def _blocks_of(p, group) -> int:
    return group["num_blocks"] if group["split"] in ("heads", "experts") else 1


def expected_ns_blocks(opt, rank_of_param) -> int:
    """Blocks this rank should orthogonalize: all of its local and fallback parameters' blocks, and those of the
    sharded parameters it owns (assign_owners over each mesh's parameters in the optimizer's order)."""
    from torch.distributed.tensor import DTensor

    from k3.train.per_head_muon import _block_dims
    from k3.train.sharded_muon import assign_owners, ns_cost, owner_split_applies

    by_mesh, total = {}, 0
    for group in opt.param_groups:
        if not group["use_muon"]:
            continue
        for p in group["params"]:
            if isinstance(p, DTensor) and owner_split_applies(p):
                key = tuple(p.device_mesh.mesh.tolist())
                by_mesh.setdefault(key, []).append((p, group))
            else:
                total += _blocks_of(p, group)
    for key, items in by_mesh.items():
        costs = [ns_cost(*_block_dims(p.shape, g), g["ns_steps"]) for p, g in items]
        owners = assign_owners(costs, len(key))
        me = rank_of_param(items[0][0])
        total += sum(_blocks_of(p, g) for (p, g), o in zip(items, owners) if o == me)
    return total


def check_ns_blocks(opt, opt_ref, world: int) -> list[int]:
    """Each rank orthogonalized exactly what it owns (plus its unsharded blocks); returns every rank's count."""
    counts = [None] * world
    dist.all_gather_object(counts, opt.last_ns_blocks)
    assert opt.last_ns_blocks == expected_ns_blocks(opt, lambda p: p.device_mesh.get_local_rank())
    return counts


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
        grads = [[torch.randn(p.shape, generator=gen) for p in ref.parameters()] for _ in range(MUON_STEPS)]
        opt_ref = PerHeadMuon(muon_param_groups(ref), lr=1e-2)
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        opt = PerHeadMuon(muon_param_groups(model), lr=1e-2)
        assert [n for n, _ in model.named_parameters()] == names
        if world == 3:  # 64 rows as 22 + 22 + 20, the router's 2 rows as 1 + 1 + 0 (an empty shard)
            rows = [p.to_local().shape[0] for p in model.parameters()]
            assert any(p.shape[0] % 3 for p in model.parameters()) and (0 in rows or rank < 2)
        for step_grads in grads:
            for p, g in zip(ref.parameters(), step_grads):
                p.grad = g.clone()
            for p, g in zip(model.parameters(), step_grads):
                p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements)
            opt_ref.step()
            opt.step()
            counts = check_ns_blocks(opt, opt_ref, world)
            # every block orthogonalized once over the ranks, and every rank owning a share
            assert sum(counts) == opt_ref.last_ns_blocks and min(counts) > 0, (counts, opt_ref.last_ns_blocks)
        for n, p, q in zip(names, model.parameters(), ref.parameters()):
            err = rel_err(full(p.detach()), q.detach())
            assert err <= MUON_TOL, f"rank {rank}: {n} differs from the single-device step by {err:.2e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_per_head_muon_on_fsdp_shards(tmp_path, world):
    mp.start_processes(muon_worker, args=(world, str(tmp_path / "store")), nprocs=world, start_method="fork")


# Parameters on two meshes, as dense and expert parameters are under FSDP x EP: a flat mesh of 4 ranks, and the "b"
# rows of a 2 x 2 mesh (two groups of 2 ranks with their own values). (global shape, split, blocks, layout): layout
# "flat" / "sub" is Shard(0) on that mesh (owner split), "2d" (Shard(0), Replicate) on the 2 x 2 mesh and "rep"
# Replicate on the flat mesh take the whole-gather path, "local" is a plain tensor.
TWO_MESH_PARAMS = [
    ((15, 6), "heads", 3, "flat"),      # 4 + 4 + 4 + 3 rows: heads cut across ranks
    ((5, 7), "none", None, "flat"),     # 2 + 2 + 1 + 0
    ((5, 7), "none", None, "flat"),     # same shape, batched with the other where they share an owner
    ((3, 9), "none", None, "flat"),     # smaller than the mesh: 1 + 1 + 1 + 0
    ((20, 3), "none", None, "flat"),    # tall (Newton-Schulz on the transpose)
    ((3, 4, 6), "experts", 3, "flat"),
    ((3, 6, 4), "experts", 3, "sub"),   # 2 + 1 experts
    ((1, 5, 4), "experts", 1, "sub"),   # 1 + 0
    ((6, 5), "heads", 2, "sub"),
    ((5, 7), "none", None, "sub"),
    ((6, 4), "none", None, "2d"),
    ((4, 4), "none", None, "rep"),
    ((4, 6), "none", None, "local"),
]


def two_mesh_worker(rank: int, world: int, store: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from k3.train.per_head_muon import PerHeadMuon

    init(rank, world, store)
    try:
        flat = init_device_mesh("cpu", (4,))
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        sub, team = grid["b"], grid.get_local_rank("a")  # this rank's 2-rank mesh and which of the two it is
        layouts = {"flat": (flat, [Shard(0)]), "sub": (sub, [Shard(0)]), "2d": (grid, [Shard(0), Replicate()]),
                   "rep": (flat, [Replicate()])}
        gens = {"sub": torch.Generator().manual_seed(100 + team)}  # each 2-rank group its own values
        shared = torch.Generator().manual_seed(0)

        def draw(shape, layout):
            return torch.randn(shape, generator=gens.get(layout, shared))

        ref_params = [draw(shape, layout) for shape, _, _, layout in TWO_MESH_PARAMS]
        params = []
        for t, (_, _, _, layout) in zip(ref_params, TWO_MESH_PARAMS):
            if layout == "local":
                params.append(torch.nn.Parameter(t.clone()))
            else:
                mesh, placements = layouts[layout]
                params.append(torch.nn.Parameter(distribute_tensor(t.clone(), mesh, placements)))
        ref_params = [torch.nn.Parameter(t) for t in ref_params]

        def groups(ps):  # one group per split (meshes mixed within a group), in TWO_MESH_PARAMS order
            out = {}
            for p, (_, split, n, _) in zip(ps, TWO_MESH_PARAMS):
                out.setdefault((split, n), {"params": [], "use_muon": True, "split": split, "num_blocks": n})
                out[(split, n)]["params"].append(p)
            return list(out.values())

        opt_ref = PerHeadMuon(groups(ref_params), lr=1e-2)
        opt = PerHeadMuon(groups(params), lr=1e-2)
        for _ in range(MUON_STEPS):
            for q, p, (shape, _, _, layout) in zip(ref_params, params, TWO_MESH_PARAMS):
                g = draw(shape, layout)
                q.grad = g.clone()
                p.grad = g.clone() if layout == "local" else distribute_tensor(g, p.device_mesh, p.placements)
            opt_ref.step()
            opt.step()
            assert opt.last_ns_blocks == expected_ns_blocks(opt, lambda p: p.device_mesh.get_local_rank())
            assert opt.last_ns_blocks < opt_ref.last_ns_blocks
        for i, (p, q) in enumerate(zip(params, ref_params)):
            err = rel_err(full(p.detach()), q.detach())
            assert err <= MUON_TOL, f"rank {rank}: parameter {i} {TWO_MESH_PARAMS[i]} differs by {err:.2e}"
    finally:
        dist.destroy_process_group()


def test_per_head_muon_owner_split_on_two_meshes(tmp_path):
    mp.start_processes(two_mesh_worker, args=(4, str(tmp_path / "store")), nprocs=4, start_method="fork")


# ---------------------------------------------------------------------------------------------------------
# The trainer under torch.distributed
# ---------------------------------------------------------------------------------------------------------
STEPS, SEQ, ROWS = 5, 32, 4  # global batch of 4 rows; 2 data ranks of 2 rows each
# QK-Clip's threshold under context parallelism: below the tiny model's largest MLA logits (about 0.1 at
# initialization), so that some heads are clipped at every step and the clip's rescaling is part of what must agree
CLIP_TAU = 0.09


def train_setup(cp: int = 1, quarters: bool = False, qat: bool = False):
    """(model, loader, TrainConfig) of every run of these tests. `qat`: MXFP4 quantization-aware training of the
    routed experts (test_qat_distributed.py), with balancing off: Quantile Balancing's histogram bins would add
    discrete flips of their own to QAT's discontinuous rounding."""
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
    if qat:
        from k3.train.qat import apply_qat

        tcfg.qat, tcfg.balance = "mxfp4", "none"
        apply_qat(model, "mxfp4")
    return model, loader, tcfg


def step_record(m) -> dict:
    """What the tests compare of a step's metrics."""
    return {"loss": m.loss, "mtp_loss": m.mtp_loss, "max_logit": m.max_logit, "clipped_heads": m.clipped_heads}


def trainer_worker(rank: int, world: int, store: str, ep: int, out: str, cp: int = 1, quarters: bool = False,
                   qat: bool = False) -> None:
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.parallelize import ParallelizeOptions, parallelize
    from k3.train.distributed import DistributedTrainer

    init(rank, world, store)
    try:
        model, loader, tcfg = train_setup(cp, quarters, qat)
        tcfg.out = out
        mesh = ParallelDims.from_flags(world, None, ep=ep, cp=cp).build_mesh("cpu")
        parallelize(model, mesh, ParallelizeOptions())
        if qat and ep > 1:  # the expert-parallel slices keep the formats they are trained in
            from k3.parallel.expert_parallel import ExpertParallelExperts

            ex = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
            assert ex and all(e.weights == "mxfp4" and e.activations == "mxfp8" for e in ex)
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


def single_process_run(cp: int = 1, quarters: bool = False, qat: bool = False
                       ) -> tuple[list[dict], K3ForCausalLM, dict | None]:
    """(every step's record, the trained model, the first batch's gradients under cp > 1)."""
    from k3.train.trainer import Trainer

    model, loader, tcfg = train_setup(cp, quarters, qat)
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


# AdamW's update of an element is m / (sqrt(v) + eps), blind to the gradient's size: an element whose gradient is near
# eps (a zero-initialized AttnRes pseudo-query, an embedding row of a rare token) moves by a fraction of the learning
# rate set by fp32 rounding, so another summation order of the same gradient (the ranks' reduction, the grouped GEMMs
# over both ranks' tokens) shows there enlarged. How much depends on the CPU's kernels: after 5 steps, under 1e-5 on
# 2 ranks (FSDP) on the machine these tests were first written on; on an AMD EPYC 8.2e-5 (2 ranks, FSDP), 4.2e-5
# (2 ranks, EP) and 1.2e-4 (4 ranks, FSDP x EP), each on an AttnRes pseudo-query. A wrong gradient moves whole rows by
# O(lr), which is O(1) of these parameters' largest entries.
ADAMW_TOL = 1e-3


def by_optimizer(ref_model: K3ForCausalLM, tol: float, adamw_tol: float = ADAMW_TOL):
    """Parameter name -> tolerance: `adamw_tol` for the AdamW parameters (see ADAMW_TOL), `tol` for the rest (the Muon
    matrices, whose whole-block orthogonalization keeps the gradients' precision, and the router biases)."""
    from k3.train.per_head_muon import describe_param_groups

    adamw = {n for n, rule in describe_param_groups(ref_model).items() if rule.startswith("adamw")}
    return lambda name: adamw_tol if name in adamw else tol


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
    # few 1e-7), and Newton-Schulz enlarges such differences to a few 1e-5 after 5 steps: 1e-4; losses still agree
    # to 1e-5. AdamW parameters: ADAMW_TOL.
    assert_params_match(out, ref_model, by_optimizer(ref_model, TOL if ep == 1 else 1e-4))


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
    assert_params_match(out, ref_model, by_optimizer(ref_model, 1e-4))  # as for --ep 2 on 2 ranks (see above)


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
        model, loader, tcfg = train_setup(quarters=world == 4)
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


@pytest.mark.parametrize("saved,world", [(2, 2), (2, 1), (4, 2)], ids=["2to2", "2to1", "4to2"])
def test_resume_from_sharded_checkpoint(tmp_path, reference, saved, world):
    from k3.checkpoint import from_pretrained
    from k3.run_dir import latest_checkpoint, sharded_state
    from k3.train.checkpointing import checkpoint_path

    out = str(tmp_path / "run")
    mp.start_processes(resume_worker, args=(saved, str(tmp_path / "store1"), out, False), nprocs=saved,
                       start_method="fork")
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
    if 4 in (saved, world):
        # the single process with the rows each rank had per forward: quarters before the save, halves after (the
        # same means; AdamW would turn the other rounding of another grouping into larger steps on elements whose
        # gradient is near its eps)
        from k3.train.trainer import Trainer

        ref_model, loader, tcfg = train_setup(quarters=saved == 4)
        trainer = Trainer(ref_model, tcfg, loader)
        ref_steps = [step_record(trainer.train_step()) for _ in range(FIRST)]
        trainer.cfg.micro_batch_rows = ROWS // world if world > 1 else ROWS // 2
        ref_steps += [step_record(trainer.train_step()) for _ in range(STEPS - FIRST)]
    ref_losses = [r["loss"] for r in ref_steps]
    losses = torch.load(f"{out}/losses-first.pt") + torch.load(f"{out}/losses-resumed.pt")
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= TOL * abs(b), f"step {s + 1}: loss {a} vs single-process {b}"
    got = from_pretrained(checkpoint_path(out, STEPS))
    ref_sd = ref_model.state_dict()
    # Another reduction order than the single process's, which AdamW enlarges on elements whose gradient is near its
    # eps (ADAMW_TOL); the Muon parameters and the losses keep 1e-5.
    tol_of = by_optimizer(got, TOL)
    for n, t in got.state_dict().items():
        err = rel_err(t.float(), ref_sd[n].float())
        assert err <= tol_of(n), f"{n} differs from the single-process run by {err:.2e} (> {tol_of(n):.0e})"


# ---------------------------------------------------------------------------------------------------------
# Resume of an expert-parallel run: at the same mesh, on twice the ranks, and without expert parallelism
# ---------------------------------------------------------------------------------------------------------
def ep_run_worker(rank: int, world: int, store: str, out: str, ep: int, resume_from: str | None) -> None:
    """resume_from None: the uninterrupted run (--ep `ep`), saving after FIRST steps and after STEPS. Otherwise a
    run of another seed that loads `resume_from` (a step-FIRST checkpoint) and trains the remaining steps."""
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.parallelize import ParallelizeOptions, parallelize
    from k3.train.distributed import DistributedTrainer

    init(rank, world, store)
    try:
        model, loader, tcfg = train_setup(quarters=world == 4)
        tcfg.out = out
        if resume_from is not None:
            torch.manual_seed(123)
            model = tiny_model(seed=7)
        mesh = ParallelDims.from_flags(world, None, ep=ep).build_mesh("cpu")
        parallelize(model, mesh, ParallelizeOptions())
        trainer = DistributedTrainer(model, tcfg, loader, mesh)
        losses = []
        if resume_from is None:
            losses += [trainer.train_step().loss for _ in range(FIRST)]
            trainer.save()
        else:
            trainer.load(resume_from)
            assert trainer.step == FIRST
        losses += [trainer.train_step().loss for _ in range(STEPS - FIRST)]
        trainer.save()
        if rank == 0:
            torch.save(losses, f"{out}/losses.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """The uninterrupted --ep 2 run on 2 ranks: its STEPS losses and its checkpoints of steps FIRST and STEPS."""
    from k3.run_dir import sharded_state
    from k3.train.checkpointing import checkpoint_path

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ep-run")
    out = str(tmp / "run")
    mp.start_processes(ep_run_worker, args=(2, str(tmp / "store"), out, 2, None), nprocs=2, start_method="fork")
    assert sharded_state(checkpoint_path(out, FIRST)) is not None  # expert-parallel runs save it too
    return out


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (2, 1)], ids=["ep2", "dp2xep2", "ep1"])
def test_resume_of_expert_parallel_run(tmp_path, ep_run, world, ep):
    from k3.checkpoint import from_pretrained
    from k3.train.checkpointing import checkpoint_path

    out = str(tmp_path / "resumed")
    mp.start_processes(ep_run_worker, args=(world, str(tmp_path / "store"), out, ep, checkpoint_path(ep_run, FIRST)),
                       nprocs=world, start_method="fork")
    # The same mesh continues the uninterrupted run bit for bit (weights, momenta, data position, RNG, router bias
    # all restored). Another mesh computes the same sums in another grouping (each expert's rows in other ranks'
    # grouped GEMMs, the expert gradients reduced over 2 ranks where the saving run had 1): fp32 rounding, which the two Muon
    # steps after the resume leave at a few 1e-6 of each tensor's largest entry (1e-5 allowed).
    want_losses = torch.load(f"{ep_run}/losses.pt")[FIRST:]
    losses = torch.load(f"{out}/losses.pt")
    for s, (a, b) in enumerate(zip(losses, want_losses)):
        assert abs(a - b) <= TOL * abs(b), f"step {FIRST + s + 1}: loss {a} vs the uninterrupted run's {b}"
    got = from_pretrained(checkpoint_path(out, STEPS)).state_dict()
    want = from_pretrained(checkpoint_path(ep_run, STEPS)).state_dict()
    tol = 0.0 if (world, ep) == (2, 2) else TOL
    for n, t in got.items():
        err = rel_err(t, want[n])
        assert err <= tol, f"{n} differs from the uninterrupted run by {err:.2e}"
