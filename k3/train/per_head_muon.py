"""Per-Head Muon (report §2.5) for the matrix parameters, AdamW for everything else.

Muon (as in Kimi K2 / Moonlight) replaces each matrix's momentum by its approximate orthogonalization
(a quintic Newton-Schulz iteration) and rescales it so that its RMS matches a typical AdamW update. K3
refines this for the attention projections: the momentum of Q, K and V is split along the head
dimension and every head block is orthogonalized on its own, so heads with small gradients are not
drowned by heads with large ones. Routed experts, stored stacked, are orthogonalized one expert at a time.

Which parameter goes where is decided by the MODULE TYPE that owns it (`muon_param_groups`):

====================================================================  =================  ===========
parameter                                                             optimizer          weight decay
====================================================================  =================  ===========
KimiDeltaAttention q_proj/k_proj/v_proj weight [H*K, D]               Muon, per head     yes
GatedMLA q_b_proj [H*(dn+dr), r_q], kv_b_proj [H*(dn+dv), r_kv]       Muon, per head     yes
GroupedExperts w1/w3 [E, F, L], w2 [E, L, F]                          Muon, per expert   yes
any other nn.Linear weight with both dims > 1, MoEGate.weight [E, D]  Muon, whole        yes
nn.Embedding weight, K3ForCausalLM.lm_head                            AdamW              yes
the vision encoder's patch convolution [C, 3, p, p] (its input layer)  AdamW              yes
the vision encoder's position table [H0, W0, C]                       AdamW              no
vectors / scalars (norms, A_log, dt_bias, biases), nn.Conv1d taps,    AdamW              no
AttnRes pseudo-queries (nn.Linear(D, 1) ``*_res_proj``)
====================================================================  =================  ===========

Buffers (the router's score-correction bias, set by Quantile Balancing) are never optimized.

Learning rates. With the update RMS matched to AdamW (``0.2 * sqrt(max(rows, cols))``, the Moonlight /
K2 convention), Muon and AdamW share one learning rate. The default ``lr = 2e-3`` is the value that
suits the small development models (``tiny``, ``k3-mini``) with this RMS matching; at K3 scale the trainer
passes its own (K2 trained with a peak of 2e-4). Every group carries its own ``lr`` and ``initial_lr``,
so a scheduler scales all of them by one multiplier.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from k3.model.kda import KimiDeltaAttention
from k3.model.latent_moe import GroupedExperts, MoEGate
from k3.model.gated_mla import GatedMLA
from k3.ops import muon_update
from k3.ops.registry import Backends
from k3.train.sharded_muon import OwnerExchange, ns_cost, owner_split_applies

__all__ = ["newton_schulz", "muon_param_groups", "describe_param_groups", "PerHeadMuon",
           "NS_COEFFS", "MUON_RMS_SCALE"]

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon, also used by Moonlight and Kimi K2). They
# trade exact convergence for speed: after 5 steps the singular values land in roughly [0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Muon update = O * MUON_RMS_SCALE * sqrt(max(rows, cols)): an orthogonal [rows, cols] block has RMS
# 1/sqrt(max(rows, cols)), so this gives every block an update RMS of ~0.2, like AdamW's.
MUON_RMS_SCALE = 0.2

# Newton-Schulz runs on at most this many bytes of blocks per batched call (its Gram matrices and the next
# iterate add about 3x that while it runs).
NS_CHUNK_BYTES = 1 << 30
NS_EPS = 1e-7  # added to each block's Frobenius norm before dividing by it
# Bucket entries of DTensor parameters: owned here (u gathered from the shards by k3.train.sharded_muon), or
# gathered whole on every rank (the fallback for layouts other than Shard(0) on a 1-D mesh)
_OWNED, _GATHERED = "owned", "gathered"

DEFAULT_LR = 2e-3
DEFAULT_WEIGHT_DECAY = 0.1


# --------------------------------------------------------------------------------------------------
# Newton-Schulz
# --------------------------------------------------------------------------------------------------
def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32,
                  eps: float = NS_EPS) -> torch.Tensor:
    """Approximate orthogonalization U V^T of G = U S V^T by the quintic Newton-Schulz iteration.

    g: [..., rows, cols] (leading dims are a batch of independent matrices). Each matrix is first divided
    by its Frobenius norm (so every singular value is <= 1); tall matrices are transposed so the iteration
    works on the smaller Gram matrix. Computed in `dtype` (fp32 by default: deterministic on CPU; bf16 is
    the fast choice on GPUs). Returns a tensor of g's shape and dtype. Pure: g is not modified.
    """
    if g.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix (or a batch of matrices), got shape {tuple(g.shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    x = g.reshape(-1, *g.shape[-2:]).to(dtype, copy=True)
    return _orthogonalize_(x, steps, eps).reshape(g.shape).to(g.dtype).contiguous()


def _orthogonalize_(x: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Newton-Schulz on a batch x [N, rows, cols] that may be overwritten (it is normalized in place).

    Three batched GEMMs per step and nothing else: the polynomial's scalar terms ride in baddbmm's
    epilogue (beta * C + alpha * A @ B, accumulated in fp32), so a bf16 batch is never re-read by separate
    elementwise kernels. Returns [N, rows, cols], possibly a transposed view (tall matrices)."""
    a, b, c = NS_COEFFS
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    x.div_(norm.add_(eps))
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x.mT if transposed else x


def _blocks(t: torch.Tensor, split: str, num_blocks: int | None) -> torch.Tensor:
    """View a Muon parameter (or its momentum) as a batch of independent matrices [N, rows, cols]."""
    if split == "heads":
        if t.ndim != 2 or t.shape[0] % num_blocks:
            raise ValueError(f"per-head split needs a [H*d, D] matrix with H={num_blocks}, got {tuple(t.shape)}")
        return t.reshape(num_blocks, t.shape[0] // num_blocks, t.shape[1])
    if split == "experts":
        if t.ndim != 3 or t.shape[0] != num_blocks:
            raise ValueError(f"per-expert split needs an [E={num_blocks}, a, b] tensor, got {tuple(t.shape)}")
        return t
    if split == "none":
        return t.reshape(1, t.shape[0], -1)
    raise ValueError(f"unknown Muon split {split!r} (expected 'heads', 'experts' or 'none')")


def _block_dims(shape: torch.Size, group: dict) -> torch.Size:
    """(blocks, rows, cols) of a Muon parameter of this (global) shape in this group, without its data."""
    return _blocks(torch.empty(shape, device="meta"), group["split"], group["num_blocks"]).shape


# --------------------------------------------------------------------------------------------------
# Parameter classification
# --------------------------------------------------------------------------------------------------
# One class per parameter: (optimizer, split, num_blocks, weight decay?)
_ADAMW_DECAY = ("adamw", None, None, True)
_ADAMW_NO_DECAY = ("adamw", None, None, False)
_MUON_WHOLE = ("muon", "none", None, True)


def _heads(n: int):
    return ("muon", "heads", n, True)


def _experts(n: int):
    return ("muon", "experts", n, True)


def _label(cls) -> str:
    opt, split, n, _ = cls
    if opt == "adamw":
        return "adamw"
    return "muon" if split == "none" else f"muon/{split}({n})"


def _group_name(cls) -> str:
    if cls[0] == "adamw":
        return "adamw/decay" if cls[3] else "adamw/no_decay"
    return _label(cls)


def _classify(model: nn.Module) -> list[tuple[str, nn.Parameter, tuple]]:
    """[(name, param, class)] for every (deduplicated) parameter, in named_parameters order.

    Pass 1 applies the rules that need to know the owning module (per-head / per-expert projections, the
    router, the output head); pass 2 the generic rules by module type; anything left falls back on shape.
    """
    from k3.model.model import K3ForCausalLM  # local: model.py imports the whole model stack
    from k3.model.vision import PatchEmbed

    cls_of: dict[int, tuple] = {}

    def assign(p: nn.Parameter | None, cls: tuple, force: bool = True) -> None:
        if p is None:
            return
        prev = cls_of.get(id(p))
        if prev is None:
            cls_of[id(p)] = cls
        elif force and prev != cls:
            raise ValueError(f"parameter of shape {tuple(p.shape)} is claimed as both {_label(prev)} "
                             f"and {_label(cls)} (a weight shared by incompatible modules?)")

    # Pass 1: module-specific rules.
    for m in model.modules():
        if isinstance(m, KimiDeltaAttention):
            for lin in (m.q_proj, m.k_proj, m.v_proj):
                assign(lin.weight, _heads(m.num_heads))
        elif isinstance(m, GatedMLA):
            assign(m.q_b_proj.weight, _heads(m.num_heads))
            assign(m.kv_b_proj.weight, _heads(m.num_heads))
        elif isinstance(m, GroupedExperts):
            for w in (m.w1, m.w3, m.w2):
                assign(w, _experts(w.shape[0]))
        elif isinstance(m, MoEGate):
            assign(m.weight, _MUON_WHOLE)
        elif isinstance(m, K3ForCausalLM):
            assign(m.lm_head.weight, _ADAMW_DECAY)
        elif isinstance(m, nn.Embedding):
            assign(m.weight, _ADAMW_DECAY)
        elif isinstance(m, PatchEmbed):
            # The encoder's input layer, like the token embedding (Muon is for the hidden matrices), and its 2-D
            # position table, a lookup of positions that decay would pull towards no position at all.
            assign(m.proj.weight, _ADAMW_DECAY)
            assign(m.pos_emb.weight, _ADAMW_NO_DECAY)

    # Pass 2: generic rules by module type (never overriding pass 1).
    for m in model.modules():
        direct = dict(m.named_parameters(recurse=False))
        if isinstance(m, nn.Linear):
            w = m.weight
            # A Linear with a single output (or input) is a vector in disguise: the AttnRes pseudo-queries.
            assign(w, _MUON_WHOLE if min(w.shape) > 1 else _ADAMW_NO_DECAY, force=False)
            assign(m.bias, _ADAMW_NO_DECAY, force=False)
        elif isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            for p in direct.values():  # depthwise conv taps [P, 1, W] and biases
                assign(p, _ADAMW_NO_DECAY, force=False)
        for name, p in direct.items():
            if id(p) in cls_of:
                continue
            if p.ndim < 2:  # norms' gains, A_log, dt_bias, any other vector or scalar
                assign(p, _ADAMW_NO_DECAY, force=False)
            else:
                warnings.warn(f"{type(m).__name__}.{name} {tuple(p.shape)} has no optimizer rule; "
                              "using AdamW with weight decay", stacklevel=3)
                assign(p, _ADAMW_DECAY, force=False)

    return [(name, p, cls_of[id(p)]) for name, p in model.named_parameters()]


def describe_param_groups(model: nn.Module) -> dict[str, str]:
    """Parameter name -> "muon/heads(H)", "muon/experts(E)", "muon" or "adamw" (tied weights listed once)."""
    return {name: _label(cls) for name, _, cls in _classify(model)}


def muon_param_groups(model: nn.Module, weight_decay: float = DEFAULT_WEIGHT_DECAY) -> list[dict]:
    """Torch optimizer param groups for `PerHeadMuon`, derived from module types (see the module docstring).

    Each group: {"name", "params", "use_muon", "split" ("heads" | "experts" | "none" | None),
    "num_blocks" (H, E or None), "decay" (bool), "weight_decay" (`weight_decay` if decay else 0)}. Muon groups are keyed by (split, num_blocks); AdamW
    comes as "adamw/decay" (embeddings, output head) and "adamw/no_decay" (vectors, norms, scalars, conv
    taps, pseudo-queries). Empty groups are dropped. Learning rates are filled in by the optimizer.
    """
    groups: dict[str, dict] = {}
    for _, p, cls in _classify(model):
        opt, split, n, decay = cls
        name = _group_name(cls)
        if name not in groups:
            groups[name] = {"name": name, "params": [], "use_muon": opt == "muon", "split": split,
                            "num_blocks": n, "decay": decay, "weight_decay": weight_decay if decay else 0.0}
        groups[name]["params"].append(p)
    # Muon groups first, then AdamW; stable within each kind (first appearance in the model).
    return sorted(groups.values(), key=lambda g: not g["use_muon"])


OPTIMIZERS = ("per-head-muon", "muon", "adamw")


def optimizer_groups(model: nn.Module, optimizer: str = "per-head-muon",
                     weight_decay: float = DEFAULT_WEIGHT_DECAY) -> list[dict]:
    """`muon_param_groups` for one of the optimizers a study compares (report §2.5):

    * "per-head-muon" (K3's, the default): the groups as they are;
    * "muon": whole-matrix Muon: the Q, K, V (and MLA up-) projections orthogonalized as whole matrices instead of
      per head; routed experts stay separate matrices (they are separate matrices, not one split);
    * "adamw": AdamW for every parameter (the matrices with weight decay), at the same learning rate, which the
      update-RMS matching of Muon makes comparable."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is invalid: use one of {', '.join(OPTIMIZERS)}")
    groups = muon_param_groups(model, weight_decay)
    if optimizer == "per-head-muon":
        return groups
    merged: dict[str, dict] = {}
    for g in groups:
        g = dict(g)
        if g["use_muon"] and (optimizer == "adamw" or g["split"] == "heads"):
            if optimizer == "adamw":
                g.update(name="adamw/decay", use_muon=False, split=None, num_blocks=None)
            else:
                g.update(name="muon", split="none", num_blocks=None)
        if g["name"] in merged:
            merged[g["name"]]["params"] = merged[g["name"]]["params"] + g["params"]
        else:
            merged[g["name"]] = g
    return sorted(merged.values(), key=lambda g: not g["use_muon"])


# --------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------
class PerHeadMuon(torch.optim.Optimizer):
    """Muon (per head / per expert / whole matrix) on groups with ``use_muon=True``, AdamW on the rest.

    Muon step for a parameter p with gradient g (lr, wd from its group):
        buf = momentum * buf + g;   u = g + momentum * buf (Nesterov) or buf
        for each block B of u (a head's rows, an expert, or the whole matrix):
            O_B = newton_schulz(B) * 0.2 * sqrt(max(rows_B, cols_B))
        p *= 1 - lr * wd;   p -= lr * O
    AdamW step: standard bias-corrected Adam with decoupled weight decay.

    `param_groups` is the output of `muon_param_groups` (or a module, which is passed through it).
    Groups without an "lr" get `lr` (Muon) or `adamw_lr` (AdamW, default: `lr`); every group records
    "initial_lr" for schedulers. `weight_decay=None` keeps each group's own value (muon_param_groups puts
    0.1 on the decayed groups); a number replaces it on every group marked "decay": True (the no-decay
    groups stay at 0) and is the default for groups that carry neither. `ns_dtype=None` runs Newton-Schulz in bf16 on CUDA and fp32 elsewhere.
    `backends` picks the momentum and update passes (op ``muon``: k3.ops.muon_update's kernels or the PyTorch
    passes; None: ``Backends()``).
    Sharded parameters (FSDP2 DTensors, Shard(0) on a 1-D mesh, uneven or empty shards included) get the same
    blocks, scale and rounding as on one device, with each parameter orthogonalized by one owner rank
    (k3.train.sharded_muon): the momentum and the Newton-Schulz input u stay on the local shard (u rounded once
    into the Newton-Schulz dtype); per mesh, every parameter is given an owner (greedy by Newton-Schulz cost, the
    same on every rank); one all-to-all sends every rank's rows of u to the owner, which orthogonalizes its
    parameters' blocks batched with its local ones of the same shape; a second all-to-all sends every rank its
    rows of the (unscaled) update back, which it applies to its shard as ``p <- (1 - lr wd) p - lr scale o``.
    With N elements of sharded Muon parameters on a mesh of W ranks and ownership balanced, a rank sends its
    shards (N / W elements) once and receives its owned inputs (~N / W), and the scatter does the reverse:
    2 N (W - 1) / W elements move over the mesh in all, 2 / W of what one all-gather of u moves ((W - 1) N),
    in the Newton-Schulz dtype, and each rank runs 1 / W of the Newton-Schulz work. DTensors on other layouts
    (a 2-D mesh, a Replicate or Shard(1) placement) keep the simple path: u all-gathered whole, every rank
    orthogonalizing all of its blocks and applying its own rows. `last_ns_blocks` counts the blocks this rank
    orthogonalized in the last step. AdamW is elementwise and runs on DTensors as is.
    Optimizer state lives in the parameter's dtype, so state_dict()/load_state_dict() round-trips exactly
    and a resumed run continues bit-for-bit.
    """

    def __init__(self, param_groups: Iterable[dict] | nn.Module, lr: float = DEFAULT_LR, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, weight_decay: float | None = None,
                 adamw_lr: float | None = None, adamw_betas: tuple[float, float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, rms_scale: float = MUON_RMS_SCALE, ns_dtype: torch.dtype | None = None,
                 backends: Backends | None = None):
        if lr <= 0 or (adamw_lr is not None and adamw_lr <= 0):
            raise ValueError(f"learning rates must be > 0, got lr={lr}, adamw_lr={adamw_lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not all(0.0 <= b < 1.0 for b in adamw_betas):
            raise ValueError(f"adamw_betas must be in [0, 1), got {adamw_betas}")
        if weight_decay is not None and weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if isinstance(param_groups, nn.Module):
            param_groups = muon_param_groups(param_groups)
        wd_default = DEFAULT_WEIGHT_DECAY if weight_decay is None else weight_decay
        adamw_lr = lr if adamw_lr is None else adamw_lr
        groups = []
        for g in param_groups:
            if not isinstance(g, dict):
                raise TypeError("PerHeadMuon takes param groups (dicts, see muon_param_groups), not bare tensors")
            g = dict(g)
            g.setdefault("use_muon", False)
            g.setdefault("split", "none" if g["use_muon"] else None)
            g.setdefault("num_blocks", None)
            g.setdefault("lr", lr if g["use_muon"] else adamw_lr)
            g.setdefault("initial_lr", g["lr"])
            if "decay" in g:
                if weight_decay is not None:
                    g["weight_decay"] = weight_decay if g["decay"] else 0.0
                g.setdefault("weight_decay", wd_default if g["decay"] else 0.0)
            g.setdefault("weight_decay", wd_default)
            groups.append(g)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=wd_default,
                        betas=tuple(adamw_betas), eps=adamw_eps, rms_scale=rms_scale)
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype
        self.backends = backends
        self.last_ns_blocks = 0

    # A group's block layout follows the parameters it holds, not the run that saved the state: the expert groups
    # of an expert-parallel run have E / ep blocks, so a resume at another ep size keeps its own.
    LAYOUT_KEYS = ("name", "use_muon", "split", "num_blocks")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (the per-parameter state and the saved groups' hyperparameters), every group keeping its
        own LAYOUT_KEYS. ValueError naming the group when a saved group updates its parameters another way
        (Muon or AdamW, the split): the state of another model."""
        live = [{k: g[k] for k in self.LAYOUT_KEYS if k in g} for g in self.param_groups]
        for i, (saved, mine) in enumerate(zip(state_dict.get("param_groups", []), live)):
            for k in ("use_muon", "split"):
                if k in saved and saved[k] != mine.get(k):
                    raise ValueError(f"optimizer state: param group {i} ({mine.get('name')}) has {k}={mine.get(k)!r}"
                                     f", the saved one {saved[k]!r}")
        super().load_state_dict(state_dict)
        for g, keep in zip(self.param_groups, live):
            g.update(keep)

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        """Momentum per group (multi-tensor), then Newton-Schulz on every block of one shape at once: all the
        blocks of all Muon parameters that share (rows, cols, ns_steps) are copied into one batch (chunks of at most
        NS_CHUNK_BYTES), orthogonalized with three batched GEMMs per step, and added back into their
        parameters. A k3-mini step has ~220 Muon matrices but 12 block shapes (4,992 blocks of 512 x 768).
        With the ``muon`` fast backend (k3.ops.muon_update) the momentum, the Newton-Schulz input and the
        decayed update are one pass each per parameter instead of PyTorch's separate passes. Sharded parameters
        join the buckets of their owner rank only (gathered before the buckets run, scattered after); no collective
        runs inside the bucket loop, so the ranks' buckets may differ."""
        buckets: dict[tuple, list] = {}
        fused_on: dict[torch.device, bool] = {}
        exchanges: dict[tuple, OwnerExchange] = {}  # one per 1-D mesh (device type, ranks), in order of appearance
        for group in groups:
            params = [p for p in group["params"] if p.grad is not None]
            sharded = [p for p in params if isinstance(p, DTensor)]
            params = [p for p in params if not isinstance(p, DTensor)]
            for p in sharded:
                u = self._local_input(p, group)
                if owner_split_applies(p):  # its blocks orthogonalized by their owner rank
                    mesh = p.device_mesh
                    key = (mesh.device_type, tuple(mesh.mesh.tolist()))
                    if key not in exchanges:
                        exchanges[key] = OwnerExchange(mesh)
                    n, rows, cols = _block_dims(p.shape, group)
                    exchanges[key].add((p, group), u, p.shape, ns_cost(n, rows, cols, group["ns_steps"]))
                    continue
                # Another layout (a 2-D mesh, Replicate, Shard(1)): u gathered whole, all blocks orthogonalized here
                whole = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                gb = _blocks(whole.full_tensor(), group["split"], group["num_blocks"])
                key = (p.device, *gb.shape[-2:], group["ns_steps"])
                buckets.setdefault(key, []).append((p, group, gb, None, _GATHERED))
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("PerHeadMuon does not support sparse gradients")
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads = [p.grad for p in params]
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            fused = []
            for p, g, buf in zip(params, grads, bufs):
                dev = p.device
                if dev not in fused_on:
                    fused_on[dev] = muon_update.fused(dev, self.backends)
                fused.append(fused_on[p.device] and p.is_contiguous() and g.is_contiguous() and buf.is_contiguous())
            rest = [i for i, f in enumerate(fused) if not f]  # momentum of these now; the fused ones later
            if rest:
                torch._foreach_mul_([bufs[i] for i in rest], group["momentum"])
                torch._foreach_add_([bufs[i] for i in rest], [grads[i] for i in rest])
            for p, g, buf, f in zip(params, grads, bufs, fused):
                gb = _blocks(g, group["split"], group["num_blocks"])
                key = (p.device, *gb.shape[-2:], group["ns_steps"])
                buckets.setdefault(key, []).append((p, group, gb, _blocks(buf, group["split"], group["num_blocks"]), f))
        for ex in exchanges.values():  # the whole inputs of the parameters this rank owns join the shape buckets
            for i, ((p, group), u) in enumerate(ex.gather()):
                gb = _blocks(u, group["split"], group["num_blocks"])
                key = (p.device, *gb.shape[-2:], group["ns_steps"])
                buckets.setdefault(key, []).append((p, group, gb, (ex, i), _OWNED))
        self.last_ns_blocks = 0
        for (device, rows, cols, steps), items in buckets.items():
            dtype = self._ns_dtype(device)
            max_blocks = max(1, NS_CHUNK_BYTES // (rows * cols * dtype.itemsize))
            for chunk in _chunks(items, lambda item: item[2].shape[0], max_blocks):
                x = torch.empty(sum(item[2].shape[0] for item in chunk), rows, cols, device=device, dtype=dtype)
                off = 0
                for p, group, gb, bb, f in chunk:  # u = g + mu * buf (Nesterov) or buf, rounded once into x
                    dst = x[off:off + gb.shape[0]]
                    if f is _OWNED or f is _GATHERED:  # u whole already
                        dst.copy_(gb)
                    elif f:  # momentum and u in one pass
                        muon_update.momentum_(gb, bb, dst, group["momentum"], group["nesterov"])
                    else:  # momentum done above (multi-tensor)
                        muon_update.newton_schulz_input_torch(gb, bb, dst, group["momentum"], group["nesterov"])
                    off += gb.shape[0]
                o = _orthogonalize_(x, steps, NS_EPS)
                self.last_ns_blocks += x.shape[0]
                off = 0
                for p, group, gb, bb, f in chunk:
                    n = gb.shape[0]
                    lr, wd = group["lr"], group["weight_decay"]
                    scale = group["rms_scale"] * math.sqrt(max(rows, cols))
                    if f is _OWNED:  # sent back to the shards' ranks by the scatter below
                        ex, i = bb
                        ex.put(i, o[off:off + n])
                    elif f is _GATHERED:  # this rank's rows of the whole update, into its shard
                        decay_add_torch_local(p, o[off:off + n], 1 - lr * wd, -lr * scale)
                    elif f:  # on the parameter's blocks [n, rows, cols] (p is contiguous when f)
                        muon_update.decay_add_(p.view(gb.shape), o[off:off + n], 1 - lr * wd, -lr * scale)
                    else:
                        muon_update.decay_add_torch(p, o[off:off + n], 1 - lr * wd, -lr * scale)
                    off += n
        for ex in exchanges.values():  # every rank's rows of the owners' updates, into its shards
            for (p, group), o in ex.scatter():
                _, rows, cols = _block_dims(p.shape, group)
                lr, wd = group["lr"], group["weight_decay"]
                scale = group["rms_scale"] * math.sqrt(max(rows, cols))
                muon_update.decay_add_torch(p.to_local(), o, 1 - lr * wd, -lr * scale)

    def _local_input(self, p: DTensor, group: dict) -> torch.Tensor:
        """This rank's rows of the Newton-Schulz input u of a sharded parameter: momentum on the local shard, u
        formed in the Newton-Schulz dtype (rounded once, as for a local parameter)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        g, buf = p.grad.to_local(), state["momentum_buffer"].to_local()
        u = torch.empty(buf.shape, dtype=self._ns_dtype(p.device), device=buf.device)
        if muon_update.fused(buf.device, self.backends) and g.is_contiguous() and buf.is_contiguous() and g.numel():
            muon_update.momentum_(g, buf, u, group["momentum"], group["nesterov"])  # one pass, as for a local one
        else:
            buf.mul_(group["momentum"]).add_(g)
            muon_update.newton_schulz_input_torch(g, buf, u, group["momentum"], group["nesterov"])
        return u

    def _adamw_step(self, group: dict) -> None:
        """Bias-corrected Adam with decoupled weight decay, as multi-tensor kernels over the group."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        params = [p for p in group["params"] if p.grad is not None]
        by_step: dict[int, list] = {}
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("PerHeadMuon does not support sparse gradients")
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            by_step.setdefault(int(state["step"].item()), []).append(p)
        for t, ps in by_step.items():  # one bias correction per step count (all equal unless params were added)
            # Elementwise, so sharded (DTensor) parameters and their states update as their local shards: the same
            # numbers without DTensor's per-tensor dispatch, which costs ~0.5 ms per tensor and op on the host.
            grads = [_local(p.grad) for p in ps]
            ms = [_local(self.state[p]["exp_avg"]) for p in ps]
            vs = [_local(self.state[p]["exp_avg_sq"]) for p in ps]
            ps = [_local(p) for p in ps]
            torch._foreach_lerp_(ms, grads, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
            if wd != 0:
                torch._foreach_mul_(ps, 1 - lr * wd)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(1 - beta2 ** t))
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - beta1 ** t))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def decay_add_torch_local(p: DTensor, o: torch.Tensor, decay: float, alpha: float) -> None:
    """p <- decay * p + alpha * o for a sharded parameter p and the whole update o (p's global shape, any
    strides, the same on every rank): each rank keeps its slice of o (a Replicate -> p.placements
    redistribution, which communicates nothing) and updates its local shard."""
    mesh = p.device_mesh
    whole = DTensor.from_local(o.reshape(p.shape), mesh, [Replicate()] * mesh.ndim)
    muon_update.decay_add_torch(p.to_local(), whole.redistribute(mesh, p.placements).to_local(), decay, alpha)


def _chunks(items: list, size, limit: int) -> list[list]:
    """Split `items` into consecutive runs whose summed size(item) stays within `limit` (an item larger than
    the limit runs alone)."""
    out, cur, total = [], [], 0
    for item in items:
        n = size(item)
        if cur and total + n > limit:
            out.append(cur)
            cur, total = [], 0
        cur.append(item)
        total += n
    if cur:
        out.append(cur)
    return out
