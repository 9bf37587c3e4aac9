"""The sigmoid top-k router (k3.ops.moe.route) in one kernel, for inference forwards.

`route` is about nine PyTorch operations: sigmoid, the bias, top-(k+1), the gather of the selected scores, their sum,
the renormalization and the scaling (and a fill for the cutoff when k = E); a decode step runs them per MoE layer on a
handful of tokens, where each costs a launch and nothing else. `route_triton` does all of it in one program per token:
the token's E logits are loaded once, the selection is k + 1 rounds of a maximum over the biased scores (the lowest
index wins a tie), and the program writes the same four tensors `route` returns (Routing: weights, indices, scores,
cutoff). It has no backward: the router's gradient flows through `route`'s ops, so training keeps them, and
`MoEGate` asks for this op only in forwards without gradients (op ``moe_route``). ``TRITON_INTERPRET=1`` runs it on
CPU tensors (the tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.moe import Routing, route
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["route_any", "route_round", "route_round_any", "route_round_triton", "route_triton"]

# triton.language and the combine functions, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None
_MAX = None


def _route_kernel(logits_ptr, l_stride, bias_ptr, w_ptr, i_ptr, s_ptr, c_ptr, E, scaling, r_ptr, R,
                  K: tl.constexpr, E_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                  CUTOFF: tl.constexpr, ROUND: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program n: the routing of token n (module docstring); with ROUND, also the R columns after the logits in the
    same row, rounded to r_ptr's dtype into row n of r_ptr (`route_round_triton`)."""
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    em = e < E
    x = tl.load(logits_ptr + n * l_stride + e, mask=em, other=0.0).to(tl.float32)
    ex = tl.exp(-tl.abs(x))
    s = tl.where(x >= 0, 1.0 / (1.0 + ex), ex / (1.0 + ex))  # sigmoid
    tl.store(s_ptr + n * E + e, s, mask=em)
    b = s
    if HAS_BIAS:
        b = s + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    b = tl.where(em, b, -float("inf"))
    kk = tl.arange(0, K)
    picked_w = tl.full([K], 0.0, tl.float32)
    picked_i = tl.full([K], 0, tl.int64)
    for j in tl.static_range(K):
        top = tl.reduce(b, 0, _MAX)
        idx = -tl.reduce(tl.where(b == top, -e, -E_PAD), 0, _MAX)  # the lowest index among the maxima
        w = tl.reduce(tl.where(e == idx, s, 0.0), 0, _SUM)
        picked_w = tl.where(kk == j, w, picked_w)
        picked_i = tl.where(kk == j, idx.to(tl.int64), picked_i)
        b = tl.where(e == idx, -float("inf"), b)
    if CUTOFF:  # the (k+1)-th largest biased score
        tl.store(c_ptr + n, tl.reduce(b, 0, _MAX))
    else:
        tl.store(c_ptr + n, -float("inf"))
    if RENORM:
        picked_w = picked_w / (tl.reduce(picked_w, 0, _SUM) + 1e-20)
    tl.store(w_ptr + n * K + kk, picked_w * scaling)
    tl.store(i_ptr + n * K + kk, picked_i)
    if ROUND:
        for c0 in range(0, R, BLOCK_R):
            c = c0 + tl.arange(0, BLOCK_R)
            cm = c < R
            v = tl.load(logits_ptr + n * l_stride + E + c, mask=cm, other=0.0)
            tl.store(r_ptr + n * R + c, v.to(r_ptr.dtype.element_ty), mask=cm)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_route_kernel)


def route_triton(logits: Tensor, bias: Tensor | None, top_k: int, renormalize: bool = True,
                 scaling_factor: float = 1.0) -> Routing:
    """`route` in one Triton kernel (module docstring): the same arguments and results; no autograd."""
    if logits.ndim != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [N, E], got shape {tuple(logits.shape)} dtype {logits.dtype}")
    return _route(logits, logits.shape[1], bias, top_k, renormalize, scaling_factor, None)[0]


def route_round(y: Tensor, num_experts: int, bias: Tensor | None, top_k: int, renormalize: bool,
                scaling_factor: float, out_dtype: torch.dtype) -> tuple[Routing, Tensor]:
    """The routing of the router's logits y[:, :num_experts] (fp32 [N, W]: the router's columns in front of others
    in one GEMM's output) and the other columns y[:, num_experts:] rounded to `out_dtype` (a new [N, W - E] tensor):
    `route` followed by a cast, the definition of op ``moe_route_round``."""
    _check_round(y, num_experts)
    return (route(y[:, :num_experts], bias, top_k, renormalize, scaling_factor),
            y[:, num_experts:].to(out_dtype, copy=True))


def route_round_triton(y: Tensor, num_experts: int, bias: Tensor | None, top_k: int, renormalize: bool,
                       scaling_factor: float, out_dtype: torch.dtype) -> tuple[Routing, Tensor]:
    """`route_round` in the router's one kernel: each token's program also rounds the rest of its row (no kernel of
    its own for the cast)."""
    _check_round(y, num_experts)
    return _route(y, num_experts, bias, top_k, renormalize, scaling_factor, out_dtype)


def _check_round(y: Tensor, num_experts: int) -> None:
    if y.ndim != 2 or y.dtype != torch.float32:
        raise ValueError(f"y must be fp32 [N, W], got shape {tuple(y.shape)} dtype {y.dtype}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or not 1 <= num_experts < y.shape[1]:
        raise ValueError(f"num_experts must be an int in [1, W={y.shape[1]}) (the router's columns in front of "
                         f"others), got {num_experts!r}")


def _route(y: Tensor, E: int, bias: Tensor | None, top_k: int, renormalize: bool, scaling_factor: float,
           out_dtype: torch.dtype | None) -> tuple[Routing, Tensor | None]:
    """The kernel over the router's logits y[:, :E]; with `out_dtype`, also y[:, E:] rounded to it."""
    N = y.shape[0]
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias must be [E={E}] or None, got shape {tuple(bias.shape)}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, E={E}], got {top_k!r}")
    if top_k & (top_k - 1):
        raise ValueError(f"the router kernel takes a power-of-two top_k, got {top_k}")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the router kernel cannot run: {why}")
    dev = y.device
    if y.stride(1) != 1:
        y = y.contiguous()
    weights = torch.empty(N, top_k, device=dev, dtype=torch.float32)
    indices = torch.empty(N, top_k, device=dev, dtype=torch.int64)
    scores = torch.empty(N, E, device=dev, dtype=torch.float32)
    cutoff = torch.empty(N, device=dev, dtype=torch.float32)
    R = y.shape[1] - E if out_dtype is not None else 0
    rest = torch.empty(N, R, device=dev, dtype=out_dtype) if out_dtype is not None else None
    if N:
        with torch.cuda.device(dev.index if y.is_cuda else -1):  # the tensors' GPU; -1: no-op
            _kernel(_triton.interpret())[(N,)](
                y, y.stride(0) if N > 1 else y.shape[1], bias if bias is not None else y, weights, indices,
                scores, cutoff, E, float(scaling_factor), rest if rest is not None else y, R, K=top_k,
                E_PAD=1 << (E - 1).bit_length(), HAS_BIAS=bias is not None, RENORM=bool(renormalize),
                CUTOFF=top_k < E, ROUND=rest is not None, BLOCK_R=min(1024, max(16, 1 << max(R - 1, 0).bit_length())),
                num_warps=1 if E <= 256 else 4)
    return Routing(weights=weights, indices=indices, scores=scores, cutoff=cutoff), rest


def _available(target) -> tuple[bool, str]:
    return _triton.available(target)


register(Op(
    "moe_route", reference=route,
    # validated: its GPU test (tests/ops/test_moe_route.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", route_triton, _available, validated=True, cpu=True),),
    tolerance="the same experts in the same order (random logits have no ties); weights, scores and cutoff 1e-6 "
              "relative (sigmoid from exponentials, the renormalizing sum in another order)"))


def route_any(logits: Tensor, bias: Tensor | None, top_k: int, renormalize: bool = True, scaling_factor: float = 1.0,
              backends: Backends | None = None) -> Routing:
    """`route` on the implementation the registry picks for the logits (op ``moe_route``); with gradients enabled
    always `route` itself (the kernel has no backward)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return route(logits, bias, top_k, renormalize, scaling_factor)
    return dispatch("moe_route", logits, backends).fn(logits, bias, top_k, renormalize, scaling_factor)


register(Op(
    "moe_route_round", reference=route_round,
    # validated: its GPU test (tests/ops/test_moe_route.py, marked gpu) passed on an H100 (2026-12-06, fourth run)
    fast=(Fast("triton", route_round_triton, _available, validated=True, cpu=True),),
    tolerance="the routing as op moe_route's; the rounded columns exactly the cast's (the same round to nearest even)"))


def route_round_any(y: Tensor, num_experts: int, bias: Tensor | None, top_k: int, renormalize: bool,
                    scaling_factor: float, out_dtype: torch.dtype,
                    backends: Backends | None = None) -> tuple[Routing, Tensor]:
    """`route_round` in the router's kernel where the registry picks it (op ``moe_route_round``); otherwise the
    router on its own implementation (op ``moe_route``) and then the cast. No autograd."""
    impl = dispatch("moe_route_round", y, backends)
    if impl.name == "triton":
        return impl.fn(y, num_experts, bias, top_k, renormalize, scaling_factor, out_dtype)
    _check_round(y, num_experts)
    return (route_any(y[:, :num_experts], bias, top_k, renormalize, scaling_factor, backends=backends),
            y[:, num_experts:].to(out_dtype))
