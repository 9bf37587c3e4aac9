"""The routed experts of a decode step's few tokens as three kernels (op ``moe_gemv``, inference).

At decode a LatentMoE layer sees a handful of tokens, N*k (token, slot) pairs of which nearly every one goes to an
expert of its own. The grouped path (k3.ops.moe.moe_experts_grouped) still sorts the pairs by expert, searches the
group offsets, inverts the order, gathers the inputs, sets up and runs two grouped GEMMs, the activation and the
combine: about fourteen kernels per layer on a GPU for a few matrix-vector products. Here, for at most
`GEMV_MAX_TOKENS` tokens:

* gate/up: program (pair p, block of F rows) reads expert e = indices[p]'s rows of w1 and w3 (through their
  strides: the halves of serving's stacked [E, 2F, L] tensor work as they are) against token n's latent row,
  accumulates in fp32, rounds gate and up to the activations' dtype (as the grouped GEMM's output is rounded),
  applies SiTU-GLU in fp32 and writes the hidden row h[p] rounded once more;
* down: program (pair p, block of L rows) takes w2[e] against h[p] in fp32 and writes y[p] rounded to the
  activations' dtype (the grouped GEMM's rounding);
* the combine: k3.ops.moe_combine with the pairs in token order (pos = 0 .. N*k - 1): u[n] = sum_j w[n, j] y[n*k + j]
  in fp32, in slot order, as the grouped path sums; or (op ``moe_combine_norm``, asked for by the LatentMoE layer
  through GroupedExperts.forward_normed) that combine followed in the same kernel by the layer's latent RMSNorm of
  u, with RMSNorm's roundings: one kernel fewer per layer and step.

So the output is the grouped path's up to the order of the fp32 sums inside each product. Each pair reads its
expert's weights itself: with N tokens routed to the same expert its rows are read N times (from L2 after the
first), which is why the op stops at `GEMV_MAX_TOKENS` tokens and the grouped GEMMs take larger batches. Nothing is
read back to the host (a CUDA graph can capture it); there is no backward (forwards without gradients only,
k3.model.latent_moe.GroupedExperts).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.moe import _check_expert_inputs, moe_experts
from k3.ops.moe_combine import moe_combine, moe_combine_torch
from k3.ops.registry import REFERENCE, Backends, Fast, Op, dispatch, register, runs_on
from k3.ops.rms_norm import rms_norm_definition
from k3.ops.situ import situ_glu
from k3.tensors import constant

__all__ = ["GEMV_MAX_TOKENS", "check_norm", "fuses_norm", "moe_combine_norm", "moe_combine_norm_triton", "moe_gemv",
           "moe_gemv_for", "moe_gemv_triton"]

GEMV_MAX_TOKENS = 8  # up to this many tokens per layer call (64 pairs at k = 8); the grouped GEMMs above it

# Autotuned on a GPU (benchmarks/moe_gemv_tune.py times each row side by side): gate/up (rows of F per program,
# columns of L per step, warps), down (rows of L per program, columns of F per step, warps). A decode step's few
# pairs leave the first rows' grids (one program per pair and 64 or 32 rows) short of enough loads in flight to
# stream the weights at a copy's speed; the narrower rows multiply the programs.
_TUNE_GATE_UP = ((64, 128, 4), (32, 256, 4), (16, 256, 4), (16, 512, 4), (8, 512, 4), (8, 1024, 4), (4, 1024, 4),
                 (8, 256, 2))
_TUNE_DOWN = ((32, 128, 4), (32, 256, 4), (16, 256, 4), (16, 512, 4), (8, 512, 4), (8, 1024, 4), (4, 1024, 4),
              (8, 256, 2))

tl = None  # triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
_SUM = None


def moe_gemv(z: Tensor, weights: Tensor, indices: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, beta1: float,
             beta2: float, backends: Backends | None = None) -> Tensor:
    """The definition: the routed experts with SiTU-GLU (k3.ops.moe.moe_experts, the expert loop), u [N, L] in z's
    dtype. `backends` is unused (the kernels' combine reads it)."""
    return moe_experts(z, weights, indices, w1, w3, w2, lambda g, u: situ_glu(g, u, beta1, beta2))


def _gate_up_kernel(z_ptr, idx_ptr, w1_ptr, w3_ptr, h_ptr, L, F, s_zn, s_w1e, s_w1f, s_w3e, s_w3f, beta1, beta2,
                    pairs_log2, K: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    n = p // K
    e = tl.load(idx_ptr + p).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = f < F
    acc1 = tl.full([BLOCK_F], 0.0, tl.float32)
    acc3 = tl.full([BLOCK_F], 0.0, tl.float32)
    for l0 in range(0, L, BLOCK_L):
        col = l0 + tl.arange(0, BLOCK_L)
        cm = col < L
        x = tl.load(z_ptr + n * s_zn + col, mask=cm, other=0.0).to(tl.float32)[None, :]
        m2 = fm[:, None] & cm[None, :]
        w1 = tl.load(w1_ptr + e * s_w1e + f[:, None] * s_w1f + col[None, :], mask=m2, other=0.0).to(tl.float32)
        w3 = tl.load(w3_ptr + e * s_w3e + f[:, None] * s_w3f + col[None, :], mask=m2, other=0.0).to(tl.float32)
        acc1 += tl.reduce(w1 * x, 1, _SUM)
        acc3 += tl.reduce(w3 * x, 1, _SUM)
    g = acc1.to(h_ptr.dtype.element_ty).to(tl.float32)  # gate and up rounded as the grouped GEMM writes them
    u = acc3.to(h_ptr.dtype.element_ty).to(tl.float32)
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
    tl.store(h_ptr + p * F + f, ((beta1 * t1 * sig) * (beta2 * t2)).to(h_ptr.dtype.element_ty), mask=fm)


def _down_kernel(h_ptr, idx_ptr, w2_ptr, y_ptr, L, F, s_w2e, s_w2l, pairs_log2, BLOCK_L: tl.constexpr,
                 BLOCK_F: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(idx_ptr + p).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    rm = rows < L
    acc = tl.full([BLOCK_L], 0.0, tl.float32)
    for f0 in range(0, F, BLOCK_F):
        col = f0 + tl.arange(0, BLOCK_F)
        cm = col < F
        hv = tl.load(h_ptr + p * F + col, mask=cm, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w2_ptr + e * s_w2e + rows[:, None] * s_w2l + col[None, :], mask=rm[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.reduce(w * hv, 1, _SUM)
    tl.store(y_ptr + p * L + rows, acc.to(y_ptr.dtype.element_ty), mask=rm)


def _combine_norm_kernel(y_ptr, w_ptr, nw_ptr, u_ptr, L, eps, K: tl.constexpr, K_PAD: tl.constexpr,
                         BLOCK_L: tl.constexpr, FP32: tl.constexpr):
    """Program n: token n's k rows of y (pairs n*k .. n*k + k - 1) weighted and summed in fp32 and rounded to u's
    dtype, as the combine stores u; then the latent RMSNorm of that row (two passes over L: the sums, then the
    rounded sum read back, normalized and weighted), with RMSNorm's roundings (FP32: x * rstd * w unrounded)."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    jm = j < K
    w = tl.load(w_ptr + n * K + j, mask=jm, other=0.0).to(tl.float32)
    ss = tl.full([BLOCK_L], 0.0, tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        yv = tl.load(y_ptr + (n * K + j)[:, None] * L + cols[None, :], mask=jm[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)
        u = tl.reduce(yv * w[:, None], 0, _SUM).to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + n * L + cols, u, mask=cm)
        uf = u.to(tl.float32)
        ss += uf * uf
    rstd = 1.0 / tl.sqrt(tl.reduce(ss, 0, _SUM) / L + eps)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        cm = cols < L
        uf = tl.load(u_ptr + n * L + cols, mask=cm, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        if FP32:
            out = uf * rstd * nw
        else:
            out = nw * (uf * rstd).to(u_ptr.dtype.element_ty).to(tl.float32)
        tl.store(u_ptr + n * L + cols, out.to(u_ptr.dtype.element_ty), mask=cm)


@functools.lru_cache(maxsize=4)
def _kernels(interpret: bool, tune: bool = False):
    """(gate/up, down, combine-norm), jitted (one set per interpreter setting: ``triton.jit`` picks compiled or
    interpreted when it wraps the function). With `tune`, gate/up and down are autotuned over their tables
    (_TUNE_GATE_UP, _TUNE_DOWN) per shape, top-k, pair count's log2 and dtype; every config writes the same h or y
    from the same inputs (fp32 sums in another order), so the timing runs leave nothing behind."""
    import triton

    _triton.bind(globals())
    gate_up, down = triton.jit(_gate_up_kernel), triton.jit(_down_kernel)
    if tune:
        gate_up = _triton.autotuned(gate_up, _TUNE_GATE_UP, ("BLOCK_F", "BLOCK_L"), ["L", "F", "K", "pairs_log2"],
                                    _triton.within(BLOCK_F="F", BLOCK_L="L"))
        down = _triton.autotuned(down, _TUNE_DOWN, ("BLOCK_L", "BLOCK_F"), ["L", "F", "pairs_log2"],
                                 _triton.within(BLOCK_L="L", BLOCK_F="F"))
    return gate_up, down, triton.jit(_combine_norm_kernel)


def _rows(w: Tensor) -> Tensor:
    """w [E, R, C] with unit column stride (a copy only where it has not)."""
    return w if w.stride(2) == 1 else w.contiguous()


def moe_gemv_triton(z: Tensor, weights: Tensor, indices: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, beta1: float,
                    beta2: float, backends: Backends | None = None, norm: tuple[Tensor, float] | None = None,
                    autotune: bool | None = None,
                    tiles: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None, pairs: bool = False
                    ) -> Tensor:
    """`moe_gemv` as the gate/up kernel, the down kernel and the combine (the module docstring); z [N, L] with
    N <= GEMV_MAX_TOKENS, the weights in z's dtype. Forward only. `norm` (the latent RMSNorm's weight [L] and eps):
    the combine and that norm as one kernel (op ``moe_combine_norm``), RMSNorm(u) returned instead of u.
    `autotune` (None: when compiled, not in Triton's interpreter): the tile shapes of gate/up and down timed per
    shape and pair count on first use (`_kernels`), else the tables' first rows; `tiles`: (a row of _TUNE_GATE_UP,
    a row of _TUNE_DOWN) launched as given instead (what the tuning may pick, tested one by one). `pairs`: no
    combine, the down kernel's y [N*k, L] returned (pairs in token order) for a kernel that combines them itself
    (k3.ops.moe_out.moe_combine_norm_out_triton)."""
    if pairs and norm is not None:
        raise ValueError("pairs returns the experts' outputs before the combine: there is no norm to apply")
    _check_expert_inputs(z, weights, indices, w1, w3, w2)
    N, L = z.shape
    if N > GEMV_MAX_TOKENS:
        raise ValueError(f"the MoE GEMV kernels take at most {GEMV_MAX_TOKENS} tokens, got {N} (the grouped GEMMs "
                         "take more)")
    if any(w.dtype != z.dtype for w in (w1, w3, w2)):
        raise ValueError(f"the MoE GEMV kernels take expert weights in z's dtype {z.dtype}, got "
                         f"{w1.dtype}, {w3.dtype}, {w2.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (z, weights, w1, w3, w2)):
        raise RuntimeError("the MoE GEMV kernels have no backward: call them without gradients (inference forwards)")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MoE GEMV kernels cannot run: {why}")
    k = indices.shape[1]
    F = w1.shape[1]
    n_pairs = N * k
    z = z if z.stride(1) == 1 else z.contiguous()  # rows read through their stride (a view of a stacked GEMM's output)
    idx = indices.reshape(-1).contiguous()
    w1, w3, w2 = _rows(w1), _rows(w3), _rows(w2)
    h = torch.empty(n_pairs, F, device=z.device, dtype=z.dtype)
    y = torch.empty(n_pairs, L, device=z.device, dtype=z.dtype)
    if norm is not None:
        check_norm(norm, L)
    if n_pairs:
        tune = tiles is None and (not _triton.interpret() if autotune is None else autotune)
        gate_up, down, _ = _kernels(_triton.interpret(), tune)
        if tune:
            fixed_gu = fixed_down = {}
        else:  # as given, or the first rows of the tables narrowed to the shapes (the interpreter's tiny ones)
            (bf, bl, wg), (ol, of, wd) = tiles or ((min(64, _triton.pow2(F)), min(128, _triton.pow2(L)), 4),
                                                   (min(32, _triton.pow2(L)), min(128, _triton.pow2(F)), 4))
            fixed_gu = dict(BLOCK_F=bf, BLOCK_L=bl, num_warps=wg)
            fixed_down = dict(BLOCK_L=ol, BLOCK_F=of, num_warps=wd)
        pairs_log2 = (n_pairs - 1).bit_length()
        with torch.cuda.device(z.device.index if z.is_cuda else -1):
            gate_up[lambda meta: (n_pairs, -(-F // meta["BLOCK_F"]))](
                z, idx, w1, w3, h, L, F, z.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1),
                float(beta1), float(beta2), pairs_log2, K=k, **fixed_gu)
            down[lambda meta: (n_pairs, -(-L // meta["BLOCK_L"]))](h, idx, w2, y, L, F, w2.stride(0), w2.stride(1),
                                                                   pairs_log2, **fixed_down)
    if pairs:
        return y
    if norm is not None:  # the implementation the registry picks (the caller asked `fuses_norm`: the kernel)
        return dispatch("moe_combine_norm", y, backends).fn(y, weights, norm[0], norm[1], z.dtype)
    pos = constant("arange", n_pairs, z.device, torch.long)  # the pairs are in token order already
    return moe_combine(y, pos, weights, z.dtype, backends)


def check_norm(norm, L: int) -> None:
    """A latent RMSNorm's (weight [L], eps), as the combine-norm kernels take it: a clear error if it is not."""
    if not (isinstance(norm, tuple) and len(norm) == 2 and isinstance(norm[0], Tensor)):
        raise ValueError("norm must be (the RMSNorm's weight [L], eps)")
    if norm[0].shape != (L,) or not norm[0].dtype.is_floating_point:
        raise ValueError(f"the latent norm's weight must be a floating [{L}] tensor, got {tuple(norm[0].shape)} "
                         f"{norm[0].dtype}")


def moe_combine_norm_triton(y: Tensor, weights: Tensor, norm_weight: Tensor, eps: float,
                            out_dtype: torch.dtype) -> Tensor:
    """`moe_combine_norm` as one kernel (program n: token n's combine, then its norm; y [N*k, L] in token order)."""
    N, k = weights.shape
    L = y.shape[1]
    check_norm((norm_weight, eps), L)
    u = torch.empty(N, L, device=y.device, dtype=out_dtype)
    if N and L:
        *_, kernel = _kernels(_triton.interpret())
        with torch.cuda.device(y.device.index if y.is_cuda else -1):
            kernel[(N,)](y.contiguous(), weights.contiguous(), norm_weight.contiguous(), u, L, float(eps), K=k,
                         K_PAD=1 << max(k - 1, 0).bit_length(), BLOCK_L=min(1024, _triton.pow2(L)),
                         FP32=out_dtype == torch.float32 and norm_weight.dtype == torch.float32, num_warps=4)
    return u


def moe_combine_norm(y: Tensor, weights: Tensor, norm_weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """The definition (op ``moe_combine_norm``): the combine of y [N*k, L] (pairs in token order, k3.ops.moe_combine)
    in `out_dtype`, then the latent RMSNorm as k3.model.common.RMSNorm computes it."""
    N, k = weights.shape
    u = moe_combine_torch(y, torch.arange(N * k, device=y.device), weights, out_dtype)
    return rms_norm_definition(u, norm_weight, eps)


register(Op(
    "moe_gemv", reference=moe_gemv,
    # validated: its GPU tests (tests/ops/test_moe_gemv.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", moe_gemv_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32: 1e-5 (the same products summed in another order); bf16 against the grouped path 2^-7 relative "
              "(the same roundings of gate, up, hidden and y, fp32 sums in another order; a rounding that falls the "
              "other way moves one entry by a bf16 step), and against the fp32 expert loop the grouped path's 2e-2"))


def moe_gemv_for(z: Tensor, backends: Backends | None = None):
    """The kernels' function when the registry picks them (op ``moe_gemv``) for z [N, L] of at most GEMV_MAX_TOKENS
    tokens in a forward without gradients; else None (the caller runs its usual path)."""
    if torch.is_grad_enabled() or z.ndim != 2 or z.shape[0] > GEMV_MAX_TOKENS:
        return None
    impl = dispatch("moe_gemv", z, backends)
    return None if impl.name == REFERENCE else impl.fn


register(Op(
    "moe_combine_norm", reference=moe_combine_norm,
    # validated: its GPU test (tests/ops/test_moe_gemv.py, marked gpu) passed on an H100 (2026-12-06, fourth run)
    fast=(Fast("triton", moe_combine_norm_triton, _triton.available, validated=True, cpu=True),),
    tolerance="the combine's u is stored as the combine stores it (fp32 sums in slot order, rounded once) and normed "
              "with RMSNorm's roundings: fp32 1e-5 (summation order), bf16 one bf16 step (2^-7 of the largest)"))


def fuses_norm(z: Tensor, backends: Backends | None = None) -> bool:
    """Whether the GEMV path also applies the latent RMSNorm in its combine's kernel (op ``moe_combine_norm``)."""
    return runs_on("moe_combine_norm", "triton", z, backends)
