"""Expert parallelism for the routed experts, plain and MoonEP (report §5.2.1), in gloo process groups.

(a) A LatentMoE layer split over 2 and 4 EP ranks, each rank with its own tokens, against the single-process layer
on the concatenated tokens: outputs, the input gradient, the gradients of the router, the latent projections, the
shared experts (summed over ranks) and of every routed expert (the ranks' slices concatenated back into [E, ...]),
for router biases that spread the pairs, send most of them to one rank, or all of them (the other ranks then
receive nothing); MoonEP's per-rank computed pairs are exactly balanced. (b) A whole tiny K3ForCausalLM with MTP on
2 EP ranks against the single-process model on the concatenated batch: the mean of the ranks' losses and the
gradients (dense ones averaged over ranks, as data parallelism does; experts' divided by the number of ranks).
(c) The same model with MoonEP under FSDP2 on 4 ranks (dp 2 x ep 2): experts sharded over ("dp", "cp") with the
world size as their gradient divide factor, the rest over all ranks; loss and full gradients as in (b).

Tolerance: everything is fp32 and the distributed layer computes the same products as the single-process one:
each token's expert outputs are row-wise identical maths, the combine sums the same K fp32 terms (in slot rather
than expert order), and a weight gradient sums the same per-token terms split over ranks, copies and the
dispatch's grouping. So results differ by fp32 rounding of sums over at most a few hundred terms, well inside
1e-5 of the largest entry (fp32 epsilon 1.2e-7).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import randomize_, rel_err

from k3.config import K3Config
from k3.model.latent_moe import LatentMoE
from k3.model.model import K3ForCausalLM
from k3.parallel.expert_parallel import ExpertParallelExperts, apply_expert_parallel, shard_experts

TOL = 1e-5
S = 24  # tokens per rank in the layer tests
CASES = {"spread": 0.0, "skewed": 0.25, "one_rank": 2.0}  # router bias added to the last rank's experts
EXPERT_PARAMS = ("experts.w1", "experts.w3", "experts.w2")


def cfg() -> K3Config:
    return K3Config.from_preset("tiny")  # 8 routed experts, top-2, fp32


def make_layer(R: int, case: str) -> LatentMoE:
    """The same random layer in every process; `case` adds a bias to the last of R ranks' experts."""
    layer = LatentMoE(cfg().replace(num_nextn_predict_layers=0), layer_idx=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 if p.ndim > 1
                    else 1 + 0.1 * torch.randn(p.shape, generator=gen))
        bias = layer.gate.e_score_correction_bias
        bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))
        n = bias.numel() // R
        bias[-n:] += CASES[case]
    return layer


def layer_data(R: int):
    gen = torch.Generator().manual_seed(1)
    D = cfg().hidden_size
    return torch.randn(R * S, D, generator=gen), torch.randn(R * S, D, generator=gen)


def expert_names(names) -> list[str]:
    return [n for n in names if n.endswith(EXPERT_PARAMS)]


def init(rank: int, R: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=60))


# ---------------------------------------------------------------------------------------------
# (a) one LatentMoE layer
# ---------------------------------------------------------------------------------------------


def layer_worker(rank: int, R: int, store: str, out: str):
    init(rank, R, store)
    try:
        x_all, w_all = layer_data(R)
        mine = slice(rank * S, (rank + 1) * S)
        res = {}
        for moon in (False, True):
            for case in CASES:
                layer = apply_expert_parallel(make_layer(R, case), None, moon_ep=moon)
                x = x_all[mine].clone().requires_grad_()
                y = layer(x)
                (y * w_all[mine]).sum().backward()  # this rank's part of the loss: the ranks' parts sum to it
                res[moon, case] = dict(y=y.detach(), dx=x.grad, pairs=layer.experts.computed_pairs,
                                       grads={k: p.grad for k, p in layer.named_parameters()})
        # MoonEP needs equal token counts: every rank sees the gathered counts, so every rank raises
        layer = apply_expert_parallel(make_layer(R, "spread"), None, moon_ep=True)
        try:
            layer(x_all[mine][: S - (rank == 0)])
        except ValueError as e:
            res["unequal"] = str(e)
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def layer_runs(request, tmp_path_factory):
    R = request.param
    tmp = tmp_path_factory.mktemp(f"ep{R}")
    # fork: the children inherit the imported modules (a spawned interpreter re-imports torch, seconds each)
    mp.start_processes(layer_worker, args=(R, str(tmp / "store"), str(tmp)), nprocs=R, start_method="fork")
    return R, [torch.load(tmp / f"rank{r}.pt") for r in range(R)]


def reference_layer(R: int, case: str):
    layer = make_layer(R, case)
    x_all, w_all = layer_data(R)
    x = x_all.clone().requires_grad_()
    y = layer(x)
    (y * w_all).sum().backward()
    return y.detach(), x.grad, {k: p.grad for k, p in layer.named_parameters()}


@pytest.mark.parametrize("moon", [False, True], ids=["ep", "moon_ep"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_single_process(layer_runs, moon, case):
    R, runs = layer_runs
    res = [r[moon, case] for r in runs]
    y, dx, grads = reference_layer(R, case)
    assert rel_err(torch.cat([r["y"] for r in res]), y) < TOL
    assert rel_err(torch.cat([r["dx"] for r in res]), dx) < TOL
    for name, g in grads.items():
        if name in expert_names(grads):  # each rank holds E/R experts, in rank order
            got = torch.cat([r["grads"][name] for r in res])
        else:  # replicated: every rank's gradient of its own part of the loss
            got = sum(r["grads"][name] for r in res)
        assert got.shape == g.shape and rel_err(got, g) < TOL, (name, rel_err(got, g))
    pairs = res[0]["pairs"]
    assert all(r["pairs"] == pairs for r in res) and sum(pairs) == R * S * cfg().num_experts_per_token
    ratio = max(pairs) / (sum(pairs) / R)
    if moon:
        assert ratio == 1.0, pairs
    elif case != "spread":
        assert ratio > 1.5, pairs  # the bias does concentrate the pairs (all of them on one rank for "one_rank")
    if case == "one_rank" and not moon:
        assert pairs[:-1] == [0] * (R - 1)


def test_moon_ep_needs_equal_token_counts(layer_runs):
    _, runs = layer_runs
    assert all("same number of tokens" in r["unequal"] for r in runs)


# ---------------------------------------------------------------------------------------------
# (b, c) a whole model: EP on 2 ranks; FSDP2 with EP on 4 (dp 2 x ep 2)
# ---------------------------------------------------------------------------------------------

B, T = 2, 16  # rows and tokens of each data rank's batch


def make_model() -> K3ForCausalLM:
    return randomize_(K3ForCausalLM(cfg()), seed=0)  # tiny, with one MTP layer


def model_batch(data_ranks: int):
    return torch.randint(1, cfg().vocab_size, (data_ranks * B, T), generator=torch.Generator().manual_seed(2))


def train_loss(model, ids):
    out = model(ids, labels=ids)
    return out.loss + 0.3 * out.mtp_loss  # each a mean over this rank's tokens


def model_worker(rank: int, R: int, store: str, out: str):
    init(rank, R, store)
    try:
        from k3.train.per_head_muon import describe_param_groups

        ids = model_batch(R)[rank * B:(rank + 1) * B]
        res = {}
        for moon in (False, True):
            model = apply_expert_parallel(make_model(), None, moon_ep=moon)
            loss = train_loss(model, ids)
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                if p.grad is None:  # the first AttnRes site's (it has a single source): none here either
                    continue
                g = p.grad.clone()
                if not name.endswith(EXPERT_PARAMS):
                    dist.all_reduce(g)  # data parallelism's average of the dense gradients (gloo has no AVG)
                grads[name] = g / R  # experts': the gradient of the sum of the ranks' losses, over R
            dist.all_reduce(lost := loss.detach().clone())
            res[moon] = dict(loss=lost / R, grads=grads, muon=describe_param_groups(model),
                             imbalance=[m.imbalance for m in model.modules() if isinstance(m, ExpertParallelExperts)])
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def reference_model(data_ranks: int):
    model = make_model()
    loss = train_loss(model, model_batch(data_ranks))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check_model(got_loss, got_grads, loss, grads):
    assert rel_err(got_loss, loss) < TOL
    assert got_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert got_grads[name].shape == g.shape and rel_err(got_grads[name], g) < TOL, name


def test_model_matches_single_process(tmp_path):
    R = 2
    mp.start_processes(model_worker, args=(R, str(tmp_path / "store"), str(tmp_path)), nprocs=R, start_method="fork")
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    loss, grads = reference_model(R)
    E = cfg().num_experts
    for moon in (False, True):
        res = [r[moon] for r in runs]
        assert res[0]["grads"].keys() == grads.keys()
        got = {n: (torch.cat([r["grads"][n] for r in res]) if n.endswith(EXPERT_PARAMS) else res[0]["grads"][n])
               for n in grads}
        check_model(res[0]["loss"], got, loss, grads)
        names = expert_names(grads)
        assert names and any(".mtp." in n or n.startswith("mtp.") for n in names)  # the MTP layer's MoE too
        assert all(res[0]["muon"][n] == f"muon/experts({E // R})" for n in names)  # per local expert
        if moon:
            assert all(i == 1.0 for r in res for i in r["imbalance"])


def fsdp_worker(rank: int, world: int, store: str, out: str):
    init(rank, world, store)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from k3.parallel.fsdp import apply_fsdp
        from k3.parallel.mesh import ParallelDims, data_rank

        dims = ParallelDims(dp_shard=2, ep=2, cp=1)
        mesh = dims.build_mesh("cpu")
        d, n = data_rank(mesh)
        ids = model_batch(n)[d * B:(d + 1) * B]
        model = apply_expert_parallel(make_model(), mesh, moon_ep=True)
        shard_experts(model, mesh["dp", "cp"]._flatten("dp_cp"), gradient_divide_factor=world)
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        moe = model.model.layers[1].block_sparse_moe
        assert moe.experts.w1.device_mesh.size() == 2 and moe.gate.weight.device_mesh.size() == world
        loss = train_loss(model, ids)
        loss.backward()
        # full_tensor: experts' gradients gathered over dp (this ep rank's slice), the rest over all ranks
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
        dist.all_reduce(lost := loss.detach().clone())
        torch.save(dict(loss=lost / world, grads=grads, ep=mesh["ep"].get_local_rank()), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_with_expert_parallel(tmp_path):
    world = 4
    mp.start_processes(fsdp_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                       start_method="fork")
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    loss, grads = reference_model(world)
    by_ep = {r["ep"]: r for r in runs}
    assert runs[0]["grads"].keys() == grads.keys()
    got = {n: (torch.cat([by_ep[e]["grads"][n] for e in range(2)]) if n.endswith(EXPERT_PARAMS)
               else runs[0]["grads"][n]) for n in grads}
    check_model(runs[0]["loss"], got, loss, grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts device-to-host synchronizations on CUDA")
def test_moon_ep_layer_reads_the_host_once_per_forward(tmp_path):
    # The expert-parallel layer's one device-to-host read per forward is the gathered router counts (the host-int
    # split sizes of the all-to-alls); the plan, bases and slots go to the device asynchronously and nothing else
    # reads back. One process (an NCCL group of one GPU) runs the same code path as R ranks, without copies.
    import warnings

    from k3.ops.moe import grouped_used

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dev = torch.device("cuda")
        layer = apply_expert_parallel(make_layer(1, "spread"), None, moon_ep=True).to(dev, torch.bfloat16)
        if not grouped_used(dev, torch.bfloat16):
            pytest.skip("the routed experts run on the reference loop here, which reads counts back by design")
        x = torch.randn(4 * S, cfg().hidden_size, device=dev, dtype=torch.bfloat16)
        routing = layer.gate(x)
        z = layer.routed_expert_down_proj(x)
        layer.experts(z, routing)  # warm-up (pinned-memory pool, kernels)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                layer.experts(z, routing)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
    finally:
        dist.destroy_process_group()
