"""Expert load balancing for the sigmoid router (report §2.3.3, appendices C and D).

The router selects the top-k of ``scores + bias`` and returns the cutoff ``alpha_i``, the
(k+1)-th largest biased score of token i (``k3.ops.moe.route``). Expert j receives token i
iff ``s_ij + b_j > alpha_i``, i.e. iff ``b_j > r_ij`` with the *required bias*
``r_ij = alpha_i - s_ij``. With the cutoffs held fixed, the count routed to expert j is
``#{i : r_ij < b_j}``, so the bias that gives every expert its target load
``q = m * k / n`` (m tokens, n experts) is the (k/n)-quantile of ``r_:,j``: the value with
exactly q of the ``r_ij`` below it (the report's ``-quantile_{1-k/n}(s_:,j - alpha)``).
Quantile Balancing (QB) jumps to that bias and removes its mean, which leaves top-k
selection unchanged (Eq. 14). The old bias enters only through the cutoffs.

Estimators of the quantile:

* ``"histogram"`` (appendix D, the one used in training): every observed micro-batch
  scatter-adds its ``r_ij`` into a per-expert count matrix ``[E, B]`` over the range
  ``[b_min - 1, b_max + 1]`` of the bias the window started with (every ``r_ij`` lies
  there because scores are in (0, 1) and ``alpha_i`` is a biased score). Counts are
  additive, so one all-reduce at the end of the step turns the local counts into the
  histogram of the global batch, whatever the sharding over ranks and micro-batches.
  Each expert then takes the first bin whose cumulative count reaches ``ceil(q)`` and
  interpolates linearly inside it. The estimate lies in the same bin as the
  ``ceil(q)``-th smallest ``r_ij``, so within one bin width ``w = (hi - lo) / B`` of it. The
  exact estimator's value (the ``floor(q)+1``-th smallest) is the same order statistic for
  fractional q; for integral q it is the next one up, and every threshold between the two
  gives expert j exactly q tokens.
* ``"exact"``: keeps every margin of the window and takes the exact order statistic
  (single process, small batches; tests and studies).
* ``"sign"``: the fixed-step baseline ``b_j += gamma * sign(mean_load - load_j)`` of
  auxiliary-loss-free balancing, loads counted from the routed indices.
* ``"none"``: no balancing (the bias is returned unchanged); the loads are still counted, so that an
  unbalanced run can be measured (the trainer builds these only for `--balance none --balance-diagnostics`).

Diagnostics (``diagnostics=True``, `k3 train --balance-diagnostics`): to tell batch-to-batch variation from a
balancing error, the balancer also keeps the window's unbiased scores and, at ``update``, routes that same window
again with the bias it returns: ``last_ideal_load`` is the load each expert would have got had the batch been
routed with the bias computed from it (the same-batch ideal), beside ``last_load`` (routed with the bias it was
routed with). A large routed imbalance with an ideal one near 1 is variation between batches (the bias of
step t fits batch t, not batch t + 1); a large ideal imbalance is the estimator's error (the histogram's bin
width, or the fixed-cutoff approximation that Eq. 14 makes). It costs the scores' memory ([N, E] fp32 per layer
per window) and, under torch.distributed, a second all-reduce of one [E] vector per ``update``.

Causality is the caller's job: route step t with ``b(t)``, ``observe`` the routing of that
step, and call ``update`` at the end of the step; the returned bias is used from step t+1
on, so no batch is ever routed with a bias derived from itself. At inference the bias is
frozen (nobody calls ``update``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ExpertBalancer", "quantile_bias_exact", "histogram_quantile", "ideal_load_ratios", "idle_expert_counts",
           "METHODS"]

METHODS = ("histogram", "exact", "sign", "none")

# Elements of the [rows, E] margin block binned at once: bounds the temporaries of observe.
_CHUNK_ELEMENTS = 1 << 24


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_top_k(top_k: Any, num_experts: int) -> None:
    # QB needs a (k+1)-th expert to define the cutoff, and k == E leaves nothing to balance.
    if not _is_int(top_k) or not 1 <= top_k < num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}), got {top_k!r}")


def _check_routing(scores: Tensor, cutoff: Tensor, num_experts: int | None = None) -> None:
    if not isinstance(scores, Tensor) or scores.ndim != 2 or not scores.dtype.is_floating_point:
        raise ValueError(f"scores must be a floating [N, E] tensor, got {_describe(scores)}")
    N, E = scores.shape
    if num_experts is not None and E != num_experts:
        raise ValueError(f"scores must have num_experts={num_experts} columns, got shape {tuple(scores.shape)}")
    if not isinstance(cutoff, Tensor) or cutoff.shape != (N,) or not cutoff.dtype.is_floating_point:
        raise ValueError(f"cutoff must be a floating [N={N}] tensor, got {_describe(cutoff)}")


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} dtype {x.dtype}"
    return repr(type(x).__name__)


def _margins(scores: Tensor, cutoff: Tensor) -> Tensor:
    """Required biases ``r_ij = alpha_i - s_ij``: [N, E] fp32."""
    return cutoff.detach().float()[:, None] - scores.detach().float()


def _exact_quantile(r: Tensor, top_k: int) -> Tensor:
    """Per expert, the ``(floor(q)+1)``-th smallest required bias, ``q = m*k/E`` (uncentred).

    For integral q this is the report's ``-(q+1)``-th largest margin: exactly q of the
    ``r_:,j`` lie strictly below it, so (ties aside, cutoffs fixed) expert j gets q tokens.
    """
    m, E = r.shape
    rank = min((m * top_k) // E, m - 1)  # floor(q), in exact integer arithmetic
    # Contiguous rows per expert: the selection runs along the fast axis.
    return torch.kthvalue(r.T.contiguous(), rank + 1, dim=1).values


def _center(b_hat: Tensor) -> Tensor:
    """Remove the mean (a common offset does not change top-k selection); mean in float64."""
    b = b_hat.double()
    return (b - b.mean()).float()


@torch.no_grad()
def quantile_bias_exact(scores: Tensor, cutoff: Tensor, top_k: int) -> Tensor:
    """The exact QB bias (Eq. 14, mean-centred) from one routed batch.

    Args:
        scores: [N, E] unbiased router scores (``Routing.scores``).
        cutoff: [N] biased (k+1)-th largest score per token (``Routing.cutoff``).
        top_k: experts per token, 1 <= top_k < E.

    Returns:
        [E] fp32: ``b_hat - mean(b_hat)`` with ``b_hat_j`` the ``(floor(m*k/E)+1)``-th smallest
        ``cutoff_i - scores_ij`` over tokens i.
    """
    _check_routing(scores, cutoff)
    N, E = scores.shape
    _check_top_k(top_k, E)
    if N == 0:
        raise ValueError("scores must hold at least one token (N >= 1), got N = 0")
    return _center(_exact_quantile(_margins(scores, cutoff), top_k))


@torch.no_grad()
def histogram_quantile(counts: Tensor, lo: float | Tensor, hi: float | Tensor, q: float | Tensor) -> Tensor:
    """Read a quantile per row from binned counts (appendix D).

    Bin ``t`` of row e covers ``[lo + t*w, lo + (t+1)*w)`` with ``w = (hi - lo) / B``. For each
    row, select the first bin ``t`` whose cumulative count reaches ``ceil(q)``; with ``c`` the
    count before it and ``h`` the count inside it, return ``lo + (t + clip((q - c) / h, 0, 1)) * w``.
    If a row never reaches ``ceil(q)`` the last bin is used (the value is then at most ``hi``).

    Args:
        counts: [E, B] non-negative counts (integer or floating).
        lo, hi: the binned range, ``hi > lo`` (Python floats or 0-dim tensors).
        q: target count (rank) per row, ``q >= 0`` (Python float or 0-dim tensor).

    Returns:
        [E] fp32 values on ``counts.device``.
    """
    if not isinstance(counts, Tensor) or counts.ndim != 2 or counts.shape[1] < 1 or counts.dtype == torch.bool \
            or counts.dtype.is_complex:
        raise ValueError(f"counts must be a real [E, B] tensor with B >= 1, got {_describe(counts)}")
    for name, v in (("lo", lo), ("hi", hi), ("q", q)):
        if isinstance(v, Tensor):
            if v.numel() != 1:
                raise ValueError(f"{name} must be a scalar (0-dim tensor or float), got {_describe(v)}")
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number or a 0-dim tensor, got {v!r}")
    if not isinstance(lo, Tensor) and not isinstance(hi, Tensor) and not hi > lo:
        raise ValueError(f"hi must be > lo, got lo={lo!r} hi={hi!r}")
    if not isinstance(q, Tensor) and q < 0:
        raise ValueError(f"q must be >= 0, got {q!r}")

    E, B = counts.shape
    dev = counts.device
    exact_ints = not counts.dtype.is_floating_point
    cnt = counts.long() if exact_ints else counts.double()
    cum = cnt.cumsum(dim=1)
    q64 = torch.as_tensor(q, dtype=torch.float64, device=dev).reshape(())
    target = torch.ceil(q64).to(cum.dtype).expand(E, 1).contiguous()
    # First bin whose cumulative count reaches ceil(q) (cum is non-decreasing along each row).
    t = torch.searchsorted(cum, target).clamp_(max=B - 1)  # [E, 1]
    h = cnt.gather(1, t)
    c = cum.gather(1, t) - h
    h64, c64 = h.double(), c.double()
    frac = torch.where(h64 > 0, (q64 - c64) / h64.clamp(min=1e-300), torch.zeros_like(h64)).clamp_(0.0, 1.0)
    lo64 = torch.as_tensor(lo, dtype=torch.float64, device=dev).reshape(())
    hi64 = torch.as_tensor(hi, dtype=torch.float64, device=dev).reshape(())
    w = (hi64 - lo64) / B
    return (lo64 + (t.double() + frac) * w).squeeze(1).float()


class ExpertBalancer:
    """Sets one MoE layer's selection bias from the routings of a training step.

    Per step: ``observe(routing, bias)`` for every micro-batch routed with ``bias``, then
    ``new_bias = update(bias)`` once; route the next step with ``new_bias``.

    Accumulator layout: one int64 matrix ``[E, C]``. For ``"histogram"`` ``C = bins + 1``:
    columns ``0..bins-1`` are the histogram of ``r_:,j`` and the last column is the routed
    load of expert j; for ``"exact"``/``"sign"`` ``C = 1`` (the load). Under torch.distributed
    this whole matrix is summed with a single all-reduce per ``update``; the global token
    count is every histogram row's total, so nothing else travels.

    Attributes:
        num_allreduce: all-reduce calls made so far (one per distributed ``update``; two with diagnostics).
        last_load: [E] int64 loads of the window closed by the last ``update`` (global under
            torch.distributed), or None.
        last_ideal_load: with ``diagnostics``, [E] int64 loads of that window routed again with the bias the
            ``update`` returned (see the module docstring), else None.
    """

    def __init__(self, num_experts: int, top_k: int, method: str = "histogram", bins: int = 1000,
                 sign_step: float = 1e-3, diagnostics: bool = False):
        if not _is_int(num_experts) or num_experts < 2:
            raise ValueError(f"num_experts must be an int >= 2, got {num_experts!r}")
        _check_top_k(top_k, num_experts)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not _is_int(bins) or bins < 1:
            raise ValueError(f"bins must be a positive int, got {bins!r}")
        if isinstance(sign_step, bool) or not isinstance(sign_step, (int, float)) or not math.isfinite(sign_step) \
                or sign_step <= 0:
            raise ValueError(f"sign_step must be a finite number > 0, got {sign_step!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.method = method
        self.bins = bins
        self.sign_step = float(sign_step)
        self.diagnostics = bool(diagnostics)
        self.num_allreduce = 0
        self.last_load: Tensor | None = None
        self.last_ideal_load: Tensor | None = None
        self._reset()

    # ------------------------------------------------------------------ window state
    @property
    def _cols(self) -> int:
        return self.bins + 1 if self.method == "histogram" else 1

    def _reset(self) -> None:
        self._acc: Tensor | None = None  # [E, C] int64, see the class docstring
        self._range: Tensor | None = None  # [2] fp32 (lo, hi): histogram range, fixed for the window
        self._margins: list[Tensor] = []  # "exact": the [N, E] required biases of each micro-batch
        self._scores: list[Tensor] = []  # diagnostics: the [N, E] unbiased scores of each micro-batch
        self._num_tokens = 0
        self._num_batches = 0

    def _acc_on(self, device: torch.device) -> Tensor:
        if self._acc is None:
            self._acc = torch.zeros(self.num_experts, self._cols, dtype=torch.int64, device=device)
        elif self._acc.device != device:
            self._acc = self._acc.to(device)
        return self._acc

    @staticmethod
    def _range_of(bias: Tensor) -> Tensor:
        b = bias.detach().float()
        return torch.stack([b.min() - 1.0, b.max() + 1.0])

    # ------------------------------------------------------------------ accumulation
    @torch.no_grad()
    def observe(self, routing: Any, bias: Tensor) -> None:
        """Accumulate one micro-batch routed with ``bias``.

        ``routing`` has ``.scores`` [N, E], ``.cutoff`` [N] and ``.indices`` [N, k]
        (``k3.ops.moe.Routing``, as a forward run with ``stats=("routing",)`` returns it for each MoE layer in
        ``out.stats.routing``). The histogram range is taken from ``bias`` at the first
        observe of a window and kept until ``update``.
        """
        scores, cutoff, indices = routing.scores, routing.cutoff, routing.indices
        _check_routing(scores, cutoff, self.num_experts)
        N = scores.shape[0]
        if not isinstance(indices, Tensor) or indices.shape != (N, self.top_k) or indices.dtype.is_floating_point \
                or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise ValueError(f"indices must be an integer [N={N}, top_k={self.top_k}] tensor, got {_describe(indices)}")
        if not isinstance(bias, Tensor) or bias.shape != (self.num_experts,) or not bias.dtype.is_floating_point:
            raise ValueError(f"bias must be a floating [num_experts={self.num_experts}] tensor, got {_describe(bias)}")

        device = scores.device
        acc = self._acc_on(device)
        flat = acc.view(-1)
        C = self._cols
        if self.method == "histogram":
            if self._range is None:
                self._range = self._range_of(bias).to(device)
            elif self._range.device != device:
                self._range = self._range.to(device)
            self._bin(flat, scores, cutoff)
        elif self.method == "exact":
            self._margins.append(_margins(scores, cutoff))
        if self.diagnostics:
            self._scores.append(scores.detach().float())
        # Routed load: expert e's count lives in the last column, flat position e*C + C-1.
        routed = indices.reshape(-1).to(device=device, dtype=torch.int64) * C + (C - 1)
        flat.index_add_(0, routed, torch.ones((), dtype=torch.int64, device=device).expand(routed.numel()))
        self._num_tokens += N
        self._num_batches += 1

    def _bin(self, flat: Tensor, scores: Tensor, cutoff: Tensor) -> None:
        """Scatter-add ``r_ij`` into the histogram: flat position ``j*C + bin``, no loop over experts.

        ``bin = floor((r_ij - lo) / w)``, evaluated as ``(alpha_i - lo)/w - s_ij/w`` (one fused pass over
        the scores); the truncating integer cast equals the floor once clamped to ``[0, B-1]``, and the
        clamp also absorbs rounding at the ends of the range.
        """
        N, E = scores.shape
        B, C = self.bins, self._cols
        device = scores.device
        lo, hi = self._range[0], self._range[1]
        inv_w = B / (hi - lo)  # 0-dim fp32 on device: no host sync
        row_pos = (cutoff.detach().float() - lo) * inv_w  # [N]
        neg_inv_w = -inv_w
        idx_dtype = torch.int32 if E * C < 2**31 else torch.int64
        offsets = torch.arange(E, device=device, dtype=idx_dtype) * C
        rows = max(1, _CHUNK_ELEMENTS // E)
        ones = torch.ones((), dtype=torch.int64, device=device).expand(min(rows, N) * E)
        for start in range(0, N, rows):  # bounds the temporaries; a loop over tokens, not experts
            stop = min(start + rows, N)
            pos = torch.addcmul(row_pos[start:stop, None], scores[start:stop].detach().float(), neg_inv_w)
            pos = pos.to(idx_dtype).clamp_(0, B - 1).add_(offsets).view(-1)
            flat.index_add_(0, pos, ones[: pos.numel()])

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, bias: Tensor, process_group: Any = None) -> Tensor:
        """Close the window: return the new bias [E] fp32 and reset the accumulators.

        QB methods return the mean-centred quantile bias; ``"sign"`` returns
        ``bias + sign_step * sign(mean_load - load)``. If torch.distributed is initialized
        (``process_group`` or the default group) with more than one rank, the accumulated
        counts are summed with one all-reduce first (every rank must call ``update``, also
        one that observed nothing, and all ranks must hold the same ``bias``). Without
        observations (over all ranks) ``bias`` is returned unchanged.
        """
        if not isinstance(bias, Tensor) or bias.shape != (self.num_experts,) or not bias.dtype.is_floating_point:
            raise ValueError(f"bias must be a floating [num_experts={self.num_experts}] tensor, got {_describe(bias)}")
        bias32 = bias.detach().float()
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(process_group)
        if world > 1 and self.method == "exact":
            raise RuntimeError(
                "ExpertBalancer(method='exact') keeps every margin and cannot combine them across "
                f"{world} ranks; use method='histogram' under torch.distributed")
        if world == 1 and self._num_tokens == 0:
            self._reset()
            return bias32.clone()

        # A rank that saw no tokens still joins the all-reduce with zero counts and the shared range.
        acc = self._acc_on(self._acc.device if self._acc is not None else bias.device)
        if self.method == "histogram" and self._range is None:
            self._range = self._range_of(bias).to(acc.device)
        if world > 1:
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=process_group)
            self.num_allreduce += 1
        load = acc[:, -1]
        self.last_load = load.clone()

        if self.method == "none":
            new = bias32.to(acc.device)
        elif self.method == "sign":
            loadf = load.double()
            step = torch.sign(loadf.mean() - loadf) * self.sign_step
            new = (bias32.to(acc.device).double() + step).float()
            if world > 1:
                new = torch.where(load.sum() > 0, new, bias32.to(acc.device))
        elif self.method == "histogram":
            hist = acc[:, :-1]
            m = hist[0].sum()  # every token lands in exactly one bin of every row
            q = m.double() * self.top_k / self.num_experts
            new = _center(histogram_quantile(hist, self._range[0], self._range[1], q))
            if world > 1:
                new = torch.where(m > 0, new, bias32.to(acc.device))
        else:  # exact, single process
            r = self._margins[0] if len(self._margins) == 1 else torch.cat(self._margins)
            new = _center(_exact_quantile(r, self.top_k))
        if self.diagnostics:
            self.last_ideal_load = self._reroute(new.to(acc.device), acc.device, world, process_group)
        self._reset()
        return new.to(bias.device)

    def _reroute(self, bias: Tensor, device: torch.device, world: int, process_group: Any) -> Tensor:
        """[E] int64: the window's tokens (every rank's, under torch.distributed) routed again with `bias`."""
        load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        for s in self._scores:  # top-k of the biased scores, as k3.ops.moe.route selects
            idx = torch.topk(s.to(device) + bias.float()[None], self.top_k, dim=1).indices.reshape(-1)
            load.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=device).expand(idx.numel()))
        if world > 1:
            dist.all_reduce(load, op=dist.ReduceOp.SUM, group=process_group)
            self.num_allreduce += 1
        return load

    def discard(self) -> None:
        """Drop the open window's observations on this rank only (no collective): for a step that is retried."""
        self._reset()

    # ------------------------------------------------------------------ metrics
    def load_stats(self) -> dict[str, float]:
        """max/mean and min/mean of the routed loads observed in the open window (this rank).

        NaN for both if nothing was observed. (Reads two scalars from the device.)
        """
        return load_stats_of([self])[0]

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Tensor | int | float | str]:
        """Configuration and the open window (tensors and plain scalars only; no pickle needed).

        ``counts`` is the accumulator ``[E, C]`` (see the class docstring), ``hist_range`` is
        ``[lo, hi]`` or empty, ``margins`` is the concatenated ``[M, E]`` margins (``"exact"``).
        """
        E = self.num_experts
        dev = self._acc.device if self._acc is not None else torch.device("cpu")
        counts = self._acc.clone() if self._acc is not None else torch.zeros(E, self._cols, dtype=torch.int64)
        rng = self._range.clone() if self._range is not None else torch.zeros(0, dtype=torch.float32)
        if self._margins:
            margins = torch.cat(self._margins).clone()
        else:
            margins = torch.zeros(0, E, dtype=torch.float32, device=dev)
        return {
            "num_experts": E,
            "top_k": self.top_k,
            "method": self.method,
            "bins": self.bins,
            "sign_step": self.sign_step,
            "diagnostics": self.diagnostics,
            "num_tokens": self._num_tokens,
            "num_batches": self._num_batches,
            "num_allreduce": self.num_allreduce,
            "counts": counts,
            "hist_range": rng,
            "margins": margins,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the configuration must match this balancer's."""
        keys = ("num_experts", "top_k", "method", "bins", "sign_step", "num_tokens", "num_batches", "counts",
                "hist_range", "margins")
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"state dict is missing keys {missing}")
        for k in ("num_experts", "top_k", "method", "bins", "sign_step"):
            if d[k] != getattr(self, k):
                raise ValueError(f"state dict {k}={d[k]!r} does not match this balancer's {k}={getattr(self, k)!r}")
        E, C = self.num_experts, self._cols
        counts, rng, margins = d["counts"], d["hist_range"], d["margins"]
        if not isinstance(counts, Tensor) or counts.shape != (E, C) or counts.dtype != torch.int64:
            raise ValueError(f"state dict counts must be an int64 [{E}, {C}] tensor, got {_describe(counts)}")
        if not isinstance(rng, Tensor) or rng.shape not in ((0,), (2,)):
            raise ValueError(f"state dict hist_range must be a [2] or empty tensor, got {_describe(rng)}")
        if not isinstance(margins, Tensor) or margins.ndim != 2 or margins.shape[1] != E:
            raise ValueError(f"state dict margins must be an [M, {E}] tensor, got {_describe(margins)}")
        for k in ("num_tokens", "num_batches"):
            if not _is_int(d[k]) or d[k] < 0:
                raise ValueError(f"state dict {k} must be an int >= 0, got {d[k]!r}")
        self._reset()
        self.num_allreduce = int(d.get("num_allreduce", self.num_allreduce))
        if d["num_batches"] == 0:
            return
        self._num_tokens, self._num_batches = d["num_tokens"], d["num_batches"]
        self._acc = counts.clone()
        self._range = rng.float().clone() if rng.numel() == 2 else None
        self._margins = [margins.float().clone()] if margins.shape[0] > 0 else []


def load_ratios(balancers) -> list[Tensor | None]:
    """Per balancer, [max / mean, min / mean] of the expert loads observed since its last update as an fp64
    tensor on its device (None when it has observed nothing); nothing is read back to the host."""
    out: list[Tensor | None] = []
    for bal in balancers:
        if bal._acc is None or bal._num_tokens == 0:
            out.append(None)
            continue
        load = bal._acc[:, -1].double()
        mean = load.mean()
        out.append(torch.stack([load.max() / mean, load.min() / mean]))
    return out


def ideal_load_ratios(balancers) -> list[float]:
    """Per balancer, max / mean of `last_ideal_load` (diagnostics), NaN where there is none; one read per device."""
    out = [float("nan")] * len(balancers)
    by_device: dict[torch.device, list] = {}
    for i, bal in enumerate(balancers):
        if bal.last_ideal_load is not None and int(bal.last_ideal_load.numel()):
            by_device.setdefault(bal.last_ideal_load.device, []).append(i)
    for items in by_device.values():
        loads = torch.stack([balancers[i].last_ideal_load for i in items]).double()
        for i, r in zip(items, (loads.max(dim=1).values / loads.mean(dim=1)).tolist()):
            out[i] = r
    return out


def idle_expert_counts(balancers) -> list[int]:
    """Per balancer, the number of experts its last closed window routed no token to (-1 where there is none)."""
    loads = [b.last_load for b in balancers]
    have = [l for l in loads if l is not None]
    counts = iter(torch.stack([(l == 0).sum() for l in have]).tolist()) if have else iter(())
    return [next(counts) if l is not None else -1 for l in loads]


def load_stats_of(balancers) -> list[dict[str, float]]:
    """``load_stats()`` of several balancers (one per MoE layer) with one read from each device, not one each."""
    nan = float("nan")
    out = [{"max_over_mean": nan, "min_over_mean": nan} for _ in balancers]
    by_device: dict[torch.device, list] = {}
    for i, r in enumerate(load_ratios(balancers)):
        if r is not None:
            by_device.setdefault(r.device, []).append((i, r))
    for items in by_device.values():
        for (i, _), (mx, mn) in zip(items, torch.stack([r for _, r in items]).tolist()):
            out[i] = {"max_over_mean": mx, "min_over_mean": mn}
    return out
