"""A LatentMoE layer's output from its two halves in one kernel (op ``moe_out``, inference).

After the routed experts, a decode step's MoE layer (k3.model.latent_moe) still has three launches and a copy for a
handful of tokens: the latent up-projection ``r = W_up a`` of the routed experts' normed sum a (a GEMM), the shared
experts' SiTU-GLU ``h = situ(g, u)`` of their gate and up projections (a kernel) and their down-projection with r
added, ``y = W_down h + r`` (``torch.addmm``, which first copies r into its output). Here program (n, block of D
output rows) computes token n's rows of y in one pass over both weights:

* ``r = W_up[d, :] . a[n]`` summed in fp32 and rounded to the output dtype, as the up-projection's GEMM writes it;
* ``h[n] = situ(g[n], u[n])`` in fp32, rounded to the output dtype as the SiTU-GLU kernel writes it, block by block
  (each program recomputes the token's few thousand activations instead of reading them back: they cost no bytes);
* ``y = W_down[d, :] . h[n] + r`` summed in fp32 and rounded once, as addmm rounds.

So y is the composed ops' up to the order of the fp32 sums (and SiTU's exponentials, a last-bit difference before
h's rounding). Each program reads its rows of both weights once per token: with N tokens they are read N times (from
L2 after the first), which is why the layer asks for it only up to ``MOE_OUT_MAX_TOKENS`` tokens. No backward: the
layer asks for it only without gradients. a, g and u are read through their row strides (g and u are views of the
stacked projection's output).

Op ``moe_combine_norm_out`` is the same kernel one step earlier: it takes the routed experts' outputs per (token,
slot) pair, as the MoE GEMV kernels' down-projection writes them (k3.ops.moe_gemv), with their routing weights and
the latent RMSNorm's weight, and each program computes a itself: the weighted sum of its token's pairs in fp32,
rounded as the combine stores it, once for the norm's mean square and again for each block of columns it
multiplies, normed with RMSNorm's roundings (k3.ops.moe_gemv.moe_combine_norm's operations in its order, so the
output is bit for bit the two kernels'). The pairs are k rows of L (a few kilobytes per token, read from L2 by every
program); the layer's combine-norm kernel and its launch are gone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import _triton
from k3.ops.moe_gemv import check_norm, moe_combine_norm
from k3.ops.registry import Backends, Fast, Op, dispatch, register
from k3.ops.situ import situ_glu

__all__ = ["MOE_OUT_MAX_TOKENS", "moe_combine_norm_out", "moe_combine_norm_out_for", "moe_combine_norm_out_triton",
           "moe_out", "moe_out_for", "moe_out_triton"]

MOE_OUT_MAX_TOKENS = 8  # up to this many tokens per layer call; the GEMMs above it

# Autotuned on a GPU (benchmarks/moe_gemv_tune.py times each row side by side): (rows of D per program, columns per
# step of both contractions, warps); without tuning (Triton's interpreter) the first row
_TUNE_OUT = ((8, 256, 4), (4, 512, 4), (4, 1024, 4), (2, 1024, 4), (8, 512, 8), (16, 256, 4), (4, 256, 2),
             (2, 512, 2))

tl = None  # triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
_SUM = None


def moe_out(a: Tensor, gate: Tensor, up: Tensor, w_up: Tensor, w_down: Tensor, beta1: float,
            beta2: float) -> Tensor:
    """The definition: ``W_down situ(gate, up) + W_up a`` as the composed ops compute it (the SiTU-GLU rounded to
    the inputs' dtype, the up-projection rounded by its GEMM, the sum rounded once by addmm). a [N, L], gate and up
    [N, I], w_up [D, L], w_down [D, I] -> [N, D]."""
    _check(a, gate, up, w_up, w_down)
    h = situ_glu(gate, up, beta1, beta2)
    return torch.addmm(F.linear(a, w_up), h, w_down.t())


def _check(a: Tensor, gate: Tensor, up: Tensor, w_up: Tensor, w_down: Tensor, tokens: int | None = None) -> None:
    """The operands' shapes and dtypes; `tokens`: the token count N when a is not [N, L] itself (the experts' pairs
    [N*k, L] of moe_combine_norm_out)."""
    for name, t in (("a", a), ("gate", gate), ("up", up), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(t, Tensor) or t.ndim != 2 or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 2-D floating tensor, got {type(t).__name__} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    N, L = a.shape[0] if tokens is None else tokens, a.shape[1]
    I, D = gate.shape[1], w_up.shape[0]
    if gate.shape != up.shape or gate.shape[0] != N:
        raise ValueError(f"gate and up must be [N={N}, I], got {tuple(gate.shape)} and {tuple(up.shape)}")
    if w_up.shape != (D, L):
        raise ValueError(f"w_up must be [D, L={L}], got {tuple(w_up.shape)}")
    if w_down.shape != (D, I):
        raise ValueError(f"w_down must be [D={D}, I={I}], got {tuple(w_down.shape)}")
    if len({t.dtype for t in (a, gate, up, w_up, w_down)}) != 1:
        raise ValueError(f"a, gate, up and both weights must share one dtype, got {a.dtype}, {gate.dtype}, "
                         f"{up.dtype}, {w_up.dtype}, {w_down.dtype}")


def _out_kernel(a_ptr, g_ptr, u_ptr, wu_ptr, wd_ptr, y_ptr, L, I, D, s_a, s_g, s_u, s_wu, s_wd, beta1, beta2,
                tokens_log2, pw_ptr, nw_ptr, eps, K, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                COMBINE: tl.constexpr = False, K_PAD: tl.constexpr = 1, NORM_BLOCK: tl.constexpr = 1,
                FP32: tl.constexpr = False):
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    if COMBINE:  # a_ptr holds the experts' pairs [N*K, L] (token order), pw_ptr their weights [N, K]
        j = tl.arange(0, K_PAD)
        jm = j < K
        pw = tl.load(pw_ptr + n * K + j, mask=jm, other=0.0).to(tl.float32)
        ss = tl.full([NORM_BLOCK], 0.0, tl.float32)
        for l0 in range(0, L, NORM_BLOCK):  # the combine's rounded sum and its squares, as moe_combine_norm sums them
            cols = l0 + tl.arange(0, NORM_BLOCK)
            yv = tl.load(a_ptr + (n * K + j)[:, None] * L + cols[None, :], mask=jm[:, None] & (cols < L)[None, :],
                         other=0.0).to(tl.float32)
            uf = tl.reduce(yv * pw[:, None], 0, _SUM).to(y_ptr.dtype.element_ty).to(tl.float32)
            ss += uf * uf
        rstd = 1.0 / tl.sqrt(tl.reduce(ss, 0, _SUM) / L + eps)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for l0 in range(0, L, BLOCK_K):
        col = l0 + tl.arange(0, BLOCK_K)
        cm = col < L
        if COMBINE:  # a's columns: the combine again, normed with RMSNorm's roundings and rounded as it is stored
            yv = tl.load(a_ptr + (n * K + j)[:, None] * L + col[None, :], mask=jm[:, None] & cm[None, :],
                         other=0.0).to(tl.float32)
            uf = tl.reduce(yv * pw[:, None], 0, _SUM).to(y_ptr.dtype.element_ty).to(tl.float32)
            nw = tl.load(nw_ptr + col, mask=cm, other=0.0).to(tl.float32)
            if FP32:
                xa = uf * rstd * nw
            else:
                xa = nw * (uf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
            x = xa.to(y_ptr.dtype.element_ty).to(tl.float32)[None, :]
        else:
            x = tl.load(a_ptr + n * s_a + col, mask=cm, other=0.0).to(tl.float32)[None, :]
        w = tl.load(wu_ptr + d[:, None].to(tl.int64) * s_wu + col[None, :], mask=dm[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.reduce(w * x, 1, _SUM)
    r = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the up-projection as its GEMM writes it
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for i0 in range(0, I, BLOCK_K):
        col = i0 + tl.arange(0, BLOCK_K)
        cm = col < I
        g = tl.load(g_ptr + n * s_g + col, mask=cm, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + n * s_u + col, mask=cm, other=0.0).to(tl.float32)
        # SiTU-GLU in fp32 from exponentials of non-positive numbers (no overflow): tanh x = sign(x)(1 - e)/(1 + e),
        # e = exp(-2|x|), with the series x - x^3/3 + 2x^5/15 below |x| = 0.1 where 1 - e cancels
        x1 = g / beta1
        x2 = u / beta2
        e1 = tl.exp2(tl.abs(x1) * -2.8853900817779268)
        e2 = tl.exp2(tl.abs(x2) * -2.8853900817779268)
        t1 = tl.where(x1 < 0, -1.0, 1.0) * (1.0 - e1) / (1.0 + e1)
        t2 = tl.where(x2 < 0, -1.0, 1.0) * (1.0 - e2) / (1.0 + e2)
        t1 = tl.where(tl.abs(x1) < 0.1, x1 - x1 * x1 * x1 / 3.0 + 2.0 * x1 * x1 * x1 * x1 * x1 / 15.0, t1)
        t2 = tl.where(tl.abs(x2) < 0.1, x2 - x2 * x2 * x2 / 3.0 + 2.0 * x2 * x2 * x2 * x2 * x2 / 15.0, t2)
        en = tl.exp2(tl.abs(g) * -1.4426950408889634)
        sig = tl.where(g >= 0, 1.0 / (1.0 + en), en / (1.0 + en))
        h = ((beta1 * t1 * sig) * (beta2 * t2)).to(y_ptr.dtype.element_ty).to(tl.float32)  # as SiTU-GLU writes h
        w = tl.load(wd_ptr + d[:, None].to(tl.int64) * s_wd + col[None, :], mask=dm[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.reduce(w * h[None, :], 1, _SUM)
    tl.store(y_ptr + n * D + d, (acc + r).to(y_ptr.dtype.element_ty), mask=dm)


@functools.lru_cache(maxsize=4)
def _kernel(interpret: bool, tune: bool = False):
    """The jitted kernel (one per interpreter setting); with `tune`, autotuned over _TUNE_OUT per shape, token
    count's log2 and dtype (every config writes the same y from the same inputs)."""
    import triton

    _triton.bind(globals())
    kernel = triton.jit(_out_kernel)
    if not tune:
        return kernel
    # a row block wider than D, or a step wider than both contracted widths, only adds masked lanes
    return _triton.autotuned(kernel, _TUNE_OUT, ("BLOCK_D", "BLOCK_K"), ["L", "I", "D", "tokens_log2", "K"],
                             lambda c, a: c["BLOCK_D"] <= _triton.pow2(a["D"])
                             and c["BLOCK_K"] <= max(_triton.pow2(a["L"]), _triton.pow2(a["I"])))


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def moe_out_triton(a: Tensor, gate: Tensor, up: Tensor, w_up: Tensor, w_down: Tensor, beta1: float,
                   beta2: float, autotune: bool | None = None, tile: tuple[int, int, int] | None = None) -> Tensor:
    """`moe_out` as one Triton kernel (module docstring), for at most MOE_OUT_MAX_TOKENS tokens. Forward only.
    `autotune` (None: when compiled, not in Triton's interpreter): the tile shape timed per shape and token count on
    first use, else _TUNE_OUT's first row; `tile`: a row of _TUNE_OUT launched as given instead (what the tuning may
    pick, tested one by one)."""
    _check(a, gate, up, w_up, w_down)
    return _launch(a, None, gate, up, w_up, w_down, beta1, beta2, autotune, tile)


def _launch(a: Tensor, combine: tuple[Tensor, Tensor, float] | None, gate: Tensor, up: Tensor, w_up: Tensor,
            w_down: Tensor, beta1: float, beta2: float, autotune: bool | None, tile: tuple[int, int, int] | None
            ) -> Tensor:
    """The kernel on a [N, L], or (`combine`: the pairs' weights [N, k], the norm's weight [L] and eps) on the
    experts' pairs a [N*k, L] in token order, combined and normed inside."""
    N = a.shape[0] if combine is None else combine[0].shape[0]
    L, I, D = a.shape[1], gate.shape[1], w_up.shape[0]
    if N > MOE_OUT_MAX_TOKENS:
        raise ValueError(f"the MoE output kernel takes at most {MOE_OUT_MAX_TOKENS} tokens, got {N} (the GEMMs take "
                         "more)")
    extra = () if combine is None else combine[:2]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, gate, up, w_up, w_down, *extra)):
        raise RuntimeError("the MoE output kernel has no backward: call it without gradients (inference forwards)")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MoE output kernel cannot run: {why}")
    a, gate, up, w_up, w_down = (_rows(t) for t in (a, gate, up, w_up, w_down))
    y = torch.empty(N, D, device=a.device, dtype=gate.dtype)
    if combine is None:
        pw, nw, eps, k, fused = a, a, 0.0, 0, {}
    else:
        pw, nw, eps = combine[0].contiguous(), combine[1].contiguous(), float(combine[2])
        k = pw.shape[1]
        fused = dict(COMBINE=True, K_PAD=1 << max(k - 1, 0).bit_length(), NORM_BLOCK=min(1024, _triton.pow2(L)),
                     FP32=gate.dtype == torch.float32 and nw.dtype == torch.float32)
    if N and D:
        tune = tile is None and (not _triton.interpret() if autotune is None else autotune)
        bd, bk, warps = tile or _TUNE_OUT[0]
        fixed = {} if tune else dict(BLOCK_D=bd, BLOCK_K=bk, num_warps=warps)
        with torch.cuda.device(a.device.index if a.is_cuda else -1):  # the tensors' GPU; -1: no-op
            _kernel(_triton.interpret(), tune)[lambda meta: (N, -(-D // meta["BLOCK_D"]))](
                a, gate, up, w_up, w_down, y, L, I, D, a.stride(0), gate.stride(0), up.stride(0), w_up.stride(0),
                w_down.stride(0), float(beta1), float(beta2), (N - 1).bit_length(), pw, nw, eps, k, **fused, **fixed)
    return y


def moe_combine_norm_out(y: Tensor, weights: Tensor, norm_weight: Tensor, eps: float, gate: Tensor, up: Tensor,
                         w_up: Tensor, w_down: Tensor, beta1: float, beta2: float) -> Tensor:
    """The definition (op ``moe_combine_norm_out``): the routed experts' pairs y [N*k, L] (token order) combined
    with their weights [N, k] and normed by the latent RMSNorm (k3.ops.moe_gemv.moe_combine_norm, in gate's dtype),
    then `moe_out` of that: the LatentMoE layer's output from its experts' pairs and its shared experts' gate and
    up."""
    _check_pairs(y, weights, norm_weight, gate, up, w_up, w_down)
    a = moe_combine_norm(y, weights, norm_weight, eps, gate.dtype)
    return moe_out(a, gate, up, w_up, w_down, beta1, beta2)


def moe_combine_norm_out_triton(y: Tensor, weights: Tensor, norm_weight: Tensor, eps: float, gate: Tensor,
                                up: Tensor, w_up: Tensor, w_down: Tensor, beta1: float, beta2: float,
                                autotune: bool | None = None, tile: tuple[int, int, int] | None = None) -> Tensor:
    """`moe_combine_norm_out` as the MoE output kernel with the combine and the norm inside: each program sums its
    token's pairs (fp32, rounded as the combine stores u) once for the norm's mean square and again, block by block,
    for the columns it multiplies (the pairs are a few kilobytes, read from L2), with RMSNorm's roundings; one kernel
    fewer per MoE layer and step than ``moe_combine_norm`` then ``moe_out``. Arguments as `moe_out_triton`."""
    _check_pairs(y, weights, norm_weight, gate, up, w_up, w_down)
    return _launch(y, (weights, norm_weight, eps), gate, up, w_up, w_down, beta1, beta2, autotune, tile)


def _check_pairs(y: Tensor, weights: Tensor, norm_weight: Tensor, gate: Tensor, up: Tensor, w_up: Tensor,
                 w_down: Tensor) -> None:
    if not isinstance(weights, Tensor) or weights.ndim != 2 or not weights.dtype.is_floating_point:
        raise ValueError("weights must be a floating tensor [N, k]")
    if not isinstance(y, Tensor) or y.ndim != 2 or y.shape[0] != weights.numel() or y.dtype != gate.dtype:
        raise ValueError(f"the experts' pairs must be [N*k={weights.numel()}, L] in gate's dtype {gate.dtype}, got "
                         f"{(tuple(y.shape), y.dtype) if isinstance(y, Tensor) else type(y).__name__}")
    check_norm((norm_weight, 0.0), y.shape[1])
    _check(y, gate, up, w_up, w_down, tokens=weights.shape[0])


register(Op(
    "moe_out", reference=moe_out,
    # validated: its GPU tests (tests/ops/test_moe_out.py, marked gpu, autotuned tiles) passed on an H100 (2026-12-07)
    fast=(Fast("triton", moe_out_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32 1e-5 of the largest output (the same products summed in another order); bf16 one bf16 step of "
              "the largest (the up-projection and h rounded as the composed ops round them, fp32 sums in another "
              "order: a rounding that falls the other way moves one output by a step), two in the interpreter (it "
              "truncates)"))


def moe_out_for(a: Tensor, backends: Backends | None = None):
    """The kernel's function when the registry picks it (op ``moe_out``) for a [N, L] of at most MOE_OUT_MAX_TOKENS
    tokens in a forward without gradients; else None (the caller runs its GEMMs)."""
    if torch.is_grad_enabled() or a.ndim != 2 or a.shape[0] > MOE_OUT_MAX_TOKENS:
        return None
    impl = dispatch("moe_out", a, backends)
    return impl.fn if impl.name == "triton" else None


register(Op(
    "moe_combine_norm_out", reference=moe_combine_norm_out,
    # validated: its GPU tests (tests/ops/test_moe_out.py, marked gpu, autotuned tiles) and the captured decode step
    # with every fused kernel (tests/serve/test_cuda_graphs.py) passed on an H100 (2026-12-07)
    fast=(Fast("triton", moe_combine_norm_out_triton, _triton.available, validated=True, cpu=True),),
    tolerance="as moe_out's: fp32 1e-5 of the largest output; bf16 one bf16 step of the largest, two in the "
              "interpreter (the combine and the norm round where moe_combine_norm rounds: its output is moe_out's a)"))


def moe_combine_norm_out_for(a: Tensor, backends: Backends | None = None):
    """The fused kernel's function when the registry picks it (op ``moe_combine_norm_out``) for a step whose
    combined latent would be a [N, L] (at most MOE_OUT_MAX_TOKENS tokens, a forward without gradients); else None."""
    if torch.is_grad_enabled() or a.ndim != 2 or a.shape[0] > MOE_OUT_MAX_TOKENS:
        return None
    impl = dispatch("moe_combine_norm_out", a, backends)
    return impl.fn if impl.name == "triton" else None
