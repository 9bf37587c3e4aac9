"""Expert parallelism for the routed experts (report §5.2.1), applied to a finished model from outside.

`apply_expert_parallel(model, ep)` replaces the `experts` (GroupedExperts) of every LatentMoE, backbone and MTP,
by an `ExpertParallelExperts` holding only this EP rank's contiguous slice of the E routed experts: rank r of R
holds experts [r E/R, (r + 1) E/R) as `w1`, `w3` [E/R, F, L] and `w2` [E/R, L, F]. The router, the latent
projections and the shared experts stay replicated: every rank routes its own tokens, and their gradients are
reduced like any dense parameter's (FSDP / data parallel). The model imports nothing from here.

One layer's forward on every rank (its own N tokens, top-k = K, global expert ids):

1. counts: the [E] router counts of this rank, all-gathered over the EP group into [R, E] and read back to the
   host (the split sizes of the all-to-alls are host ints);
2. destinations: plain EP sends each token-expert pair to the expert's home rank e // (E/R). MoonEP plans, from
   the group's loads, redundant copies so that every rank computes exactly T = N K pairs (k3.parallel.moon_ep:
   `plan_moon_ep`), and `pair_slots` gives each pair its computing rank and row there; each rank fetches the
   weights of the copies it hosts from their home ranks (one all-to-all of the needed experts' rows);
3. dispatch: the pairs, sorted by destination (and row), travel with one all-to-all of [N K, L] rows;
4. compute: every received row runs through its expert, local or copy, with the single-device op
   (`moe_experts_any`: the reference loop or the grouped GEMMs, SiTU-GLU), unweighted;
5. combine: the results travel back by the reverse all-to-all, and each token sums its K results weighted by its
   routing weights in fp32 (`moe_combine`), as the single-device layer does: the routing weights never leave their
   rank, so their gradient is local, and the numerics are the single-device ones up to fp32 summation order.

Every all-to-all is autograd-aware (its backward is the reverse all-to-all with the split sizes swapped), and so
is the weight fetch: the gradients of a copy flow back to its home rank and add into the home expert's gradient.
An expert's gradient is therefore the gradient of the sum of the EP ranks' losses; with each rank's loss a mean
over its tokens, dividing it by the world size (FSDP2: `set_gradient_divide_factor`, see `shard_experts`) gives
the gradient of the global mean, as the dense parameters' average over all ranks does.

Host syncs per layer and forward (and again in an activation-checkpointing recompute): one, the read of the
gathered [R, E] counts. Every host-made tensor (the plan, the bases, the weight-fetch indices, the received rows'
expert slots) goes to the device asynchronously from pinned memory, and `pair_slots` runs without its validation
reads. The backward does not sync: its split sizes are the forward's host ints. Under MoonEP every rank computes
exactly T = N K rows, so the expert GEMMs' total shape is static; the rows a rank receives from each source still
vary, and `all_to_all_single` takes those split sizes as host ints, which is what the one read is for. Removing it
needs an all-to-all whose splits live on the device (NVSHMEM-style device-initiated transfers, as MoonEP's and
DeepEP's kernels do); with torch.distributed's collectives the read stays. Plain EP's compute shapes follow the
routing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from k3.model.latent_moe import GroupedExperts, LatentMoE
from k3.model.mx_experts import MXExperts
from k3.ops.mx import mxfp4_fake_quantize_any, mxfp8_fake_quantize_any
from k3.ops.moe import Routing, moe_experts_any
from k3.ops.moe_combine import moe_combine, moe_dispatch
from k3.parallel.moon_ep import MoonEPPlan, pair_slots, plan_moon_ep, rank_offsets
from k3.tensors import to_device_async

__all__ = ["all_to_all_autograd", "ExpertParallelExperts", "apply_expert_parallel", "shard_experts", "ep_group"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its current name, or the older


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows: `in_splits[r]` rows of x go to rank r, `out_splits[r]` rows come from rank r (rank
    order). Backward: the gradient of what was received goes back where it came from (splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all_autograd(x: Tensor, out_splits: list[int], in_splits: list[int],
                        group: dist.ProcessGroup | None = None) -> Tensor:
    """Rows of x [sum(in_splits), ...] exchanged over `group` (host-int split sizes, rank order): returns
    [sum(out_splits), ...], the rows every rank sent here, by source rank. Autograd-aware."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def ep_group(ep: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    """The EP process group of a group, a mesh (its "ep" dimension, or the mesh itself when 1-D) or None (world)."""
    if ep is None:
        return dist.group.WORLD
    if isinstance(ep, DeviceMesh):
        if ep.mesh_dim_names and "ep" in ep.mesh_dim_names:
            return ep["ep"].get_group()
        if ep.ndim == 1:
            return ep.get_group()
        raise ValueError(f"a mesh of {ep.ndim} dims needs an 'ep' dimension, got {ep.mesh_dim_names}")
    return ep


def _plan_to(plan: MoonEPPlan, device: torch.device) -> MoonEPPlan:
    return dataclasses.replace(plan, **{f.name: to_device_async(getattr(plan, f.name), device)
                                        for f in dataclasses.fields(plan) if isinstance(getattr(plan, f.name), Tensor)})


def _pair_matrix(counts: Tensor, n: int, plan: MoonEPPlan | None) -> Tensor:
    """[R, E, R] (host int64): pairs that source rank j routed to expert e and rank r computes.

    Plain EP: all of (j, e) at e's home rank. MoonEP: expert e's pairs, in the stable order (source rank, then
    position), are cut into consecutive ranges of `assign[e, r]` pairs in ascending r; (j, e) occupies
    [base[j, e], base[j, e] + counts[j, e]) of that order, and the result is the overlap of the two ranges."""
    R, E = counts.shape
    if plan is None:
        out = torch.zeros(R, E, R, dtype=torch.int64)
        e = torch.arange(E)
        out[:, e, e // n] = counts
        return out
    a = plan.assign.cpu()
    lo = (a.cumsum(1) - a)[None]  # [1, E, R] start of rank r's range in expert e's order
    b = rank_offsets(counts)[:, :, None]  # [R, E, 1]
    return (torch.minimum(b + counts[:, :, None], lo + a[None]) - torch.maximum(b, lo)).clamp_min(0)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.scale, None


def _scale_grad(x: Tensor, scale: float) -> Tensor:
    """x, whose gradient is multiplied by `scale` (x itself when scale is 1)."""
    return x if scale == 1.0 else _GradScale.apply(x, scale)


class ExpertParallelExperts(GroupedExperts):
    """This EP rank's slice of the routed experts (report §5.2.1), computing every routed pair of the group's
    tokens that lands on it: the module docstring has the steps. A GroupedExperts (parameters `w1`, `w3`, `w2`
    stacked per local expert, SiTU betas, `backends`), so the optimizer's per-expert Muon rule applies to it, with
    E/R blocks. `forward(z, routing)` takes this rank's tokens with global expert ids.

    With `moon_ep`, every micro-batch and layer is planned by MoonEP: every rank computes exactly N K pairs (equal
    token counts on every rank are required), hosting at most E/R redundant copies fetched from their home ranks.
    `computed_pairs` holds the pairs each EP rank computed in the last forward (the same on every rank);
    `imbalance` is their max / mean (1.0 under MoonEP)."""

    def __init__(self, experts: GroupedExperts, group: dist.ProcessGroup | None = None, moon_ep: bool = False):
        nn.Module.__init__(self)  # not GroupedExperts': the parameters are slices of the given ones
        group = dist.group.WORLD if group is None else group
        E = experts.w1.shape[0]
        R, r = dist.get_world_size(group), dist.get_rank(group)
        if E % R:
            raise ValueError(f"expert parallelism over {R} ranks needs a number of routed experts divisible by it, "
                             f"got {E}")
        n = E // R
        for name in ("w1", "w3", "w2"):
            src = getattr(experts, name)
            setattr(self, name, nn.Parameter(src.detach()[r * n:(r + 1) * n].clone(), requires_grad=src.requires_grad))
        self.beta1, self.beta2 = experts.beta1, experts.beta2
        # Multiplies the experts' gradients (identity forward): an EP rank's expert gradient sums the
        # contributions of every EP rank's tokens, so a data-parallel average over the other mesh dimensions
        # leaves it ep times the gradient of the mean loss; k3.parallel.parallelize sets 1 / ep.
        self.grad_scale = 1.0
        self.backends = experts.backends
        self.group, self.num_experts, self.ep_size, self.ep_rank, self.moon_ep = group, E, R, r, moon_ep
        # quantization-aware training (k3.train.qat): the MX formats of MXExperts, applied to this rank's rows. MX
        # blocks run along each weight row's input dim and each activation row, so slicing experts and moving token
        # rows commute with them: the same fake-quantized values as on one device.
        self.weights, self.activations = ((experts.weights, experts.activations) if isinstance(experts, MXExperts)
                                          else (None, None))
        self.computed_pairs: list[int] | None = None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def expert_range(self) -> tuple[int, int]:
        """[first, end) of the global expert ids held here (checkpoint I/O maps local row i to first + i)."""
        n = self.experts_per_rank
        return self.ep_rank * n, (self.ep_rank + 1) * n

    @property
    def imbalance(self) -> float:
        """Max / mean over the EP ranks of the pairs computed in the last forward."""
        if not self.computed_pairs:
            raise RuntimeError("no forward has run yet")
        mean = sum(self.computed_pairs) / len(self.computed_pairs)
        return max(self.computed_pairs) / mean if mean else 1.0

    def extra_repr(self) -> str:
        lo, hi = self.expert_range
        qat = f", weights={self.weights}, activations={self.activations}" if self.weights or self.activations else ""
        return f"experts [{lo}, {hi}) of {self.num_experts}, ep rank {self.ep_rank} of {self.ep_size}, " \
               f"moon_ep={self.moon_ep}{qat}"

    def _counts(self, indices: Tensor) -> Tensor:
        """[R, E] router counts of every EP rank, on the host (the layer's device-to-host read)."""
        flat = indices.reshape(-1)
        local = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        local.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))  # bincount on CUDA reads its max back
        out = local.new_empty(self.ep_size * self.num_experts)
        _all_gather(out, local, group=self.group)
        return out.view(self.ep_size, self.num_experts).cpu()

    def _copies(self, plan: MoonEPPlan, ws: tuple[Tensor, Tensor, Tensor]) -> list[Tensor] | None:
        """The weights (w1, w3, w2 rows) of the copies `plan.redundant[r]` this rank hosts, fetched from their home
        ranks by one autograd-aware all-to-all (backward: their gradients reduced into the home experts'); None
        when no rank hosts a copy (the same on every rank, so all skip the collective)."""
        red = plan.redundant.cpu()
        if bool((red < 0).all()):
            return None
        n, me = self.experts_per_rank, self.ep_rank
        send = [[e - me * n for e in row if e >= 0 and e // n == me] for row in red.tolist()]
        mine = red[me][red[me] >= 0]
        recv = torch.bincount(mine // n, minlength=self.ep_size).tolist()
        idx = to_device_async(torch.tensor([i for row in send for i in row], dtype=torch.long), self.w1.device)
        packed = torch.cat([w.reshape(n, -1)[idx] for w in ws], dim=1)
        got = all_to_all_autograd(packed, recv, [len(row) for row in send], self.group)  # rows in `mine` order
        sizes = [w[0].numel() for w in ws]
        return [g.view(len(mine), *w.shape[1:]) for g, w in zip(got.split(sizes, dim=1), ws)]

    def _compute(self, x: Tensor, slot: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        """E_slot(x) for each received row, unweighted, in x.dtype: the single-device op with unit weights."""
        if x.shape[0] == 0:
            # Nothing routed here; the result stays in the graph of x and of the weights all the same, so that this
            # rank takes part in the backward all-to-alls and its experts get a (zero) gradient like every rank's.
            return x * 0 + sum(0.0 * w.sum() for w in (w1, w3, w2)).to(x.dtype)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        act, act_fused, act13 = self.act, self.act_fused, self.act_fused13
        if self.weights == "mxfp4":  # after the copies' fetch: a copy is its home rows, quantized alike
            w1, w3, w2 = (mxfp4_fake_quantize_any(w, self.backends) for w in (w1, w3, w2))
        if self.activations == "mxfp8":  # as MXExperts: the expert inputs, and the hidden in the GEMM dtype
            dt, q = x.dtype, (lambda t: mxfp8_fake_quantize_any(t, self.backends))
            x = q(x)
            act = lambda g, u: q(self.act(g, u).to(dt))  # noqa: E731
            act_fused = lambda g, u: q(self.act_fused(g, u).to(dt))  # noqa: E731
            act13 = lambda h: q(self.act_fused13(h).to(dt))  # noqa: E731
        return moe_experts_any(x, ones, slot[:, None], w1, w3, w2, act, act_fused, act13,
                               backends=self.backends, casts=self.weight_casts)

    def forward(self, z: Tensor, routing: Routing) -> Tensor:
        """u [N, L] = sum_j p_nj E_{e_nj}(z_n) for this rank's tokens z [N, L], experts anywhere in the group."""
        N, _ = z.shape
        K = routing.indices.shape[1]
        R, E, n, me = self.ep_size, self.num_experts, self.experts_per_rank, self.ep_rank
        indices = routing.indices
        counts = self._counts(indices)
        # the weights as this forward uses them, their gradient scaled by `grad_scale` (copies fetched for MoonEP
        # included, so their gradients come home scaled too)
        w1, w3, w2 = (_scale_grad(w, self.grad_scale) for w in (self.w1, self.w3, self.w2))
        slot_of = torch.full((E,), -1, dtype=torch.long)  # global expert -> row of this rank's weight table
        slot_of[me * n:(me + 1) * n] = torch.arange(n)
        if self.moon_ep:
            totals = counts.sum(1)
            if bool((totals != N * K).any()):
                raise ValueError(f"MoonEP needs the same number of tokens on every EP rank; the ranks route "
                                 f"{(totals // K).tolist()} tokens")
            plan = plan_moon_ep(counts.sum(0), R, N * K)
            # the ids come from the router and the bases from the counts the plan was made of: no checks to read back
            base = to_device_async(rank_offsets(counts)[me], z.device)
            rank, row = pair_slots(_plan_to(plan, z.device), indices, base, check=False)
            key = (rank * (N * K) + row).reshape(-1)  # by computing rank, then row there (expert-grouped)
            copies = self._copies(plan, (w1, w3, w2))
            if copies is not None:
                mine = plan.redundant[me][plan.redundant[me] >= 0]
                slot_of[mine] = n + torch.arange(len(mine))
                w1, w3, w2 = (torch.cat([w, c]) for w, c in zip((w1, w3, w2), copies))
        else:
            plan = None
            key = indices.reshape(-1)  # experts are contiguous per rank: by expert is by home rank
        pairs = _pair_matrix(counts, n, plan)
        send, recv = pairs[me].sum(0).tolist(), pairs[:, :, me].sum(1).tolist()
        self.computed_pairs = pairs.sum((0, 1)).tolist()
        # what arrives from source j is its pairs for this rank, by expert (and, within one, in its stable order)
        slot = to_device_async(slot_of[torch.arange(E).repeat(R).repeat_interleave(pairs[:, :, me].reshape(-1))],
                               z.device)

        order = torch.argsort(key, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        x = all_to_all_autograd(moe_dispatch(z, order, inverse, K, self.backends), recv, send, self.group)
        y = all_to_all_autograd(self._compute(x, slot, w1, w3, w2), send, recv, self.group)
        return moe_combine(y, inverse, routing.weights, z.dtype, self.backends)


def apply_expert_parallel(model: nn.Module, ep: dist.ProcessGroup | DeviceMesh | None,
                          moon_ep: bool = False) -> nn.Module:
    """Split the routed experts of every LatentMoE of `model` (backbone and MTP; `model` may be one LatentMoE)
    over the EP group `ep` (a process group, a mesh with an "ep" dimension or a 1-D mesh; None: the world), in
    place, and return `model`. Every rank must hold the same full model (initialized or loaded) when this runs: it
    keeps this rank's slice of each layer's experts and drops the rest."""
    group = ep_group(ep)
    for m in list(model.modules()):
        if isinstance(m, LatentMoE) and not isinstance(m.experts, ExpertParallelExperts):
            m.experts = ExpertParallelExperts(m.experts, group, moon_ep)
    return model


def shard_experts(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
                  reshard_after_forward: bool = True, gradient_divide_factor: float | None = None) -> nn.Module:
    """FSDP2 for the EP experts: each ExpertParallelExperts its own `fully_shard` unit over `mesh`, the ranks that
    hold the same experts (the ("dp", "cp") ranks of one ep rank), before k3.parallel.fsdp.apply_fsdp shards the
    dense rest over all ranks (it leaves units already sharded alone). `gradient_divide_factor`: what FSDP divides
    the summed expert gradients by; the world size (dp x ep x cp) makes them the gradient of the mean of the
    ranks' losses, like the dense parameters' (FSDP's default, the mesh size, leaves them ep times that). The
    forward inputs are not cast: the routing weights stay fp32, as in the unsharded layer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                              cast_forward_inputs=False)
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
            if gradient_divide_factor is not None:
                m.set_gradient_divide_factor(gradient_divide_factor)
                if gloo:  # a divide factor other than the mesh size is NCCL's PreMulSum; gloo sums, then divides
                    m.set_force_sum_reduction_for_comms(True)
    return model
