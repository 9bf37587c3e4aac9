"""Building blocks shared by the model's layers: RMSNorm and the dense SiTU-GLU MLP."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.registry import Backends, notice
from k3.ops.rms_norm import rms_norm_any
from k3.ops.situ import situ_glu_any
from k3.ops.weight_cast import WeightCasts, stacked_weight, weight


def set_backends(module: nn.Module, backends: Backends | None) -> nn.Module:
    """Give `module` and every submodule `backends` (k3.ops.registry.Backends; None: the default), which the layers
    read as ``self.backends`` and pass to the ops they call. ``K3ForCausalLM.set_backends`` does this for a whole
    model; a layer built on its own takes it the same way."""
    for m in module.modules():
        m.backends = backends
    return module


class CastsWeights:
    """A module whose weights go through k3.ops.weight_cast (`Linear`, the routed experts): `weight_casts` is the
    step's :class:`~k3.ops.weight_cast.WeightCasts` while :func:`use_weight_casts` scopes one to its model, else
    None (the plain autocast path)."""

    weight_casts: WeightCasts | None = None


@contextlib.contextmanager
def use_weight_casts(model: nn.Module, casts: WeightCasts | None):
    """Within, the weights of `model`'s own modules (and no other model's) go through `casts`: under autocast
    each is cast once and its gradient summed straight into the fp32 ``.grad``. Backward of the forwards run
    within must run within too. None leaves the model as it is. The previous setting comes back on exit."""
    mods = [m for m in model.modules() if isinstance(m, CastsWeights)]
    before = [m.weight_casts for m in mods]
    for m in mods:
        m.weight_casts = casts
    try:
        yield casts
    finally:
        for m, b in zip(mods, before):
            m.weight_casts = b


class Linear(CastsWeights, nn.Linear):
    """nn.Linear whose weight goes through :func:`k3.ops.weight_cast.weight`: in training under autocast with the
    step's `weight_casts` it is cast once per step and its gradient summed straight into the fp32 ``.grad``;
    elsewhere this is nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight(self.weight, self.weight_casts), self.bias)


def stacked_linear(x: torch.Tensor, *layers: nn.Linear | tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """(layer(x) for layer in layers) for bias-free layers; with autograd recording, as one GEMM against the
    layers' weights stacked. An entry that is a tuple of layers gives one output: their outputs side by side
    (``torch.cat([l(x) for l in group], -1)``), a single view of the GEMM's output when stacked.

    In training, several projections of one input then cost one read (and, under autocast, one cast) of x and one
    GEMM instead of one each; in backward, d(x) comes from one GEMM (accumulated inside it) instead of a sum of
    per-layer gradients, and the weight gradients from one GEMM. The parameters stay separate (checkpoint names,
    Muon's per-matrix treatment); the stacked copy is made per call (small next to a training batch's
    activations), or once per training step with the layers' `weight_casts` (:func:`use_weight_casts`). It is padded
    with zero rows to a multiple of 16 outputs, so that the returned views' row stride stays 16-element aligned
    (kernels that take strided inputs, like fla's convolution, specialize on that).
    Without gradients (serving, evaluation) the layers run one by one: a per-call copy of the weights would be
    most of a decode step's traffic and would sit in every captured CUDA graph's memory. Unless the layers' weights
    already are one tensor's rows (:func:`stack_projections`, done by the serving engine): then one GEMM against it.
    """
    groups = [entry if isinstance(entry, tuple) else (entry,) for entry in layers]
    flat = [layer for g in groups for layer in g]
    sizes = [sum(layer.weight.shape[0] for layer in g) for g in groups]
    if torch.is_grad_enabled():
        pad = -sum(sizes) % 16
        casts = next((layer.weight_casts for layer in flat if isinstance(layer, CastsWeights)), None)
        w = stacked_weight([layer.weight for layer in flat], pad, casts)
    else:
        w = serving_stack(*flat)
        if w is None:
            outs = [[layer(x) for layer in g] for g in groups]
            return tuple(o[0] if len(o) == 1 else torch.cat(o, dim=-1) for o in outs)
        pad = w.shape[0] - sum(sizes)
    return F.linear(x, w).split(sizes + [pad] if pad else sizes, dim=-1)[:len(sizes)]


def serving_stack(*layers: nn.Module, quiet: bool = False) -> torch.Tensor | None:
    """The one tensor whose rows are `layers`' weights, in this order (`stack_projections`), or None: never
    stacked, stacked as another group, or stale (a weight replaced since, e.g. by ``.to()``: said once unless
    `quiet`)."""
    got = getattr(layers[0], "serving_stack", None)
    if got is None:
        return None
    stack, members, ptrs = got
    if len(members) != len(layers) or any(a is not b for a, b in zip(members, layers)):
        return None
    # (the staleness check reads addresses, which torch.compile cannot trace: a compiled step, made after the stacking
    # by the engine, is checked where it is first run eagerly)
    if not torch.compiler.is_compiling() and any(layer.weight.data_ptr() != p for layer, p in zip(layers, ptrs)):
        if not quiet:
            notice("stacked projections: a weight was replaced after stack_projections; its group runs one GEMM "
                   "per projection (call stack_projections again)")
        return None
    return stack


def _in_a_stack(layer: nn.Module) -> bool:
    got = getattr(layer, "serving_stack", None)
    return got is not None and serving_stack(*got[1], quiet=True) is not None


def stack_projections(model: nn.Module, on: bool = True) -> int:
    """For serving: every group of bias-free projections that a layer computes from one input (its
    ``projection_groups()``: KDA's q, k, v, decay, beta and gate; MLA's q_a, kv_a and gate; an MoE layer's latent
    down-projection and shared gate and up, led by the router where one GEMM can write fp32; an MLP's gate and up)
    gets its weights copied into the rows of one tensor (zero rows padding it to a multiple of 16, as in training)
    and each weight becomes a view of its rows, so that `stacked_linear` runs one GEMM per group instead of one per
    projection, reading the same bytes. The parameters stay the same objects with the same names and values (only
    their storage moves: an optimizer holding them goes on updating them), and no memory is added. Call it once the
    model has its device and dtype. The routed experts' gate and up weights likewise become the halves of one tensor
    (their ``stack_halves``: one grouped GEMM for both). Groups already stacked stay as they are. `on=False` undoes
    it (each weight its own tensor again). Returns the number of groups stacked afterwards, the experts' included."""
    n = 0
    for m in model.modules():
        if hasattr(m, "stack_halves"):  # the routed experts: w1 and w3 as the halves of one tensor per expert
            n += m.stack_halves(on)
        for group in getattr(m, "projection_groups", lambda: ())():
            if not on:
                if getattr(group[0], "serving_stack", None) is not None:
                    for l in group:
                        l.weight.data = l.weight.data.clone()
                        del l.serving_stack
                continue
            if serving_stack(*group, quiet=True) is not None:
                n += 1
                continue
            if any(_in_a_stack(l) for l in group):
                continue  # a member already sits in another group's stack (a larger group of its parent's)
            w0 = group[0].weight
            if any(getattr(l, "bias", None) is not None or l.weight.dtype != w0.dtype or l.weight.device != w0.device
                   or l.weight.shape[1] != w0.shape[1] for l in group):
                continue
            rows = sum(l.weight.shape[0] for l in group)
            stack = w0.new_zeros((rows + -rows % 16, w0.shape[1]))
            at = 0
            for l in group:  # the Parameter objects stay (an optimizer holding them updates the stack's rows)
                r = l.weight.shape[0]
                stack[at:at + r].copy_(l.weight.data)
                l.weight.data = stack[at:at + r]
                at += r
            ptrs = tuple(l.weight.data_ptr() for l in group)
            for l in group:
                l.serving_stack = (stack, tuple(group), ptrs)
            n += 1
    return n


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the normalized value is cast back before the weight, as the release does."""

    backends: Backends | None = None  # which implementation runs the op (K3ForCausalLM.set_backends)

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # Nothing to cast back: x * rsqrt(mean(x^2) + eps) * weight as one op (a fused kernel forward and
            # backward on CUDA; on CPU the same ops as below, in the same order).
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, times the weight, rounded again: one Triton
        # kernel each way on CUDA (op rms_norm), the same ops as written out otherwise.
        return rms_norm_any(x, self.weight, self.eps, backends=self.backends)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SituMLP(nn.Module):
    """Dense FFN (layer 0) and the fused shared experts: down(SiTU-GLU(gate x, up x)), report §2.3.2."""

    backends: Backends | None = None  # which implementation runs SiTU-GLU (K3ForCausalLM.set_backends)

    def __init__(self, hidden: int, intermediate: int, beta1: float, beta2: float):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.beta1, self.beta2 = beta1, beta2

    def projection_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The projections of one input that `stacked_linear` computes together, in its order."""
        return ((self.gate_proj, self.up_proj),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = stacked_linear(x, self.gate_proj, self.up_proj)
        return self.from_projections(gate, up)

    def from_projections(self, gate: torch.Tensor, up: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of `forward` once gate_proj(x) and up_proj(x) are computed (by a parent's GEMM of them), plus
        `add` (of the output's shape) where given. Without gradients that sum is the down-projection GEMM's own
        epilogue (``torch.addmm``: one kernel, the sum rounded once where ``down_proj(h) + add`` rounds the product
        and then the sum); otherwise the two are added."""
        h = situ_glu_any(gate, up, self.beta1, self.beta2, backends=self.backends)
        if add is None:
            return self.down_proj(h)
        down = self.down_proj
        if torch.is_grad_enabled() or down.bias is not None or getattr(down, "weight_casts", None) is not None \
                or add.dtype != h.dtype or down.weight.dtype != h.dtype:
            return down(h) + add
        out = torch.addmm(add.reshape(-1, add.shape[-1]), h.reshape(-1, h.shape[-1]), down.weight.t())
        return out.view(add.shape)
