"""The routed experts computed straight from MXFP4 storage: the served form of an MXFP4 checkpoint (report §4.1.4).

The release keeps each routed expert matrix W [out, in] as ``weight_packed`` (uint8 [out, in/2], two E2M1 codes per
byte) and ``weight_scale`` (uint8 [out, in/32], E8M0); k3.ops.mx defines the format. Served packed, the experts
take a quarter of the memory of bf16 and every decode step reads a quarter of the bytes. The experts are stacked
as in memory ([E, F, L/2] for w1 and w3, [E, L, F/2] for w2, scales alike), and

    u_n = sum_j p_nj * w2[e_nj] @ act( w1[e_nj] @ a(z_n), w3[e_nj] @ a(z_n) )      act = SiTU-GLU (beta1, beta2)

with ``a`` the MXFP8 rounding of each expert GEMM's input (the latent z before w1 and w3, the hidden before w2,
per token in blocks of 32 along the contracted dimension) when ``activations="mxfp8"`` (how K3 is deployed and
QAT trains), the identity when None (the release's config).

Implementations (op ``mx_moe``):

* the reference (:func:`mx_moe_packed`): the expert loop of k3.ops.moe.moe_experts, each expert that received
  tokens dequantized on the fly (to the inputs' dtype: exact for bf16 and fp32) just before its GEMMs and dropped
  after. Its output is bitwise the dequantize-at-load model's (the same GEMMs on the same values); the memory
  held is the packed storage plus one expert's dense weights at a time.
* ``triton`` (:func:`mx_moe_packed_triton`): token-centric GEMV kernels in the spirit of WarpDecode (§5.4.2), for
  decode's few tokens: one program per (token, slot, block of F rows) decodes its rows of w1 and w3 from the
  packed bytes in registers, accumulates both projections in fp32 and applies SiTU-GLU; one program per (token,
  slot, block of L rows) does the same with w2 and writes that pair's output (rounded to the activations' dtype,
  as the reference rounds each expert's output); k3.ops.moe_combine sums each token's pairs in fp32. Each step of
  a program takes a few 32-column blocks: the codes' low nibbles multiply the even columns of the input and the
  high nibbles the odd ones (no interleave), each block's sum is scaled once by its E8M0 scale (one multiply per
  32 weights, not per weight). Nothing dense is ever written: the bytes read are the packed rows of the experts
  the pairs touch, every pair its own (many tokens per expert re-read them, which the grouped kernels avoid).
  The MXFP8 rounding of z and of the hidden runs between the kernels (k3.ops.mx's encoder); block sizes are
  autotuned per shape on a GPU. ``TRITON_INTERPRET=1`` runs it on CPU tensors (the tests).
* ``triton_grouped`` (:func:`mx_moe_packed_grouped`, kernels in k3.ops.mx_moe_grouped): expert-centric, for decode
  and prefill alike: the (token, slot) pairs sorted by expert and cut into tiles of up to 16-64 rows of one expert;
  one program per (tile, block of output rows) reads the expert's packed rows once for the whole tile, decodes them
  in registers (Triton's ``tl.dot_scaled`` for bf16/fp16 inputs, or its own decode) and multiplies on the matrix
  units with fp32 accumulation; SiTU-GLU in the gate/up epilogue, per-(token, slot) outputs from the down kernel,
  then the deterministic fp32 combine of k3.ops.moe_combine. No host sync (CUDA graphs can capture it). Validated:
  its GPU tests (1, 16, 64 and 512 tokens, and the capture in a CUDA graph) passed on an H100 (2026-12-06), where it
  ran a release-shaped layer faster than the dequantized bf16 experts at 1, 16 and 64 tokens (1.04x, 1.19x, 1.21x).
  While the pairs number at most three quarters of the experts (:func:`takes_gemv`) it hands the call to the
  token-centric kernels (a decode step: nearly every pair an expert of its own, where a GEMV streams the packed rows
  and a tile of one real row wastes the matrix unit). On an H100 (2026-12-07, replayed from CUDA graphs) the op
  then ran a release-shaped layer (384 experts, top-16) 1.97x, 1.81x, 1.44x and 1.27x as fast as the dequantized
  bf16 experts at 1, 4, 16 and 64 tokens (BENCHMARKS.md).

The choice (k3.ops.registry): ``auto`` takes the first implementation that is available and validated:
``triton_grouped`` on CUDA (the token-centric kernels alone, for every size, stay unvalidated), and the inference
commands keep MXFP4 checkpoints packed there (k3.checkpoint packs where op ``mx_moe`` runs on a kernel); on CPU
``auto`` keeps the reference, which decodes at load. ``fast`` names the first, the token-centric kernels.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.moe import expert_load
from k3.ops.moe_combine import moe_combine
from k3.ops.mx import MX_BLOCK, mxfp4_dequantize, mxfp8_fake_quantize, mxfp8_fake_quantize_any
from k3.ops.mx_moe_grouped import grouped_experts
from k3.ops.registry import Backends, Fast, Op, dispatch, register
from k3.ops.situ import situ_glu

__all__ = ["ACTIVATIONS", "GEMV_MAX_PAIRS_PER_EXPERT", "PackedExpertWeights", "mx_moe_packed", "mx_moe_packed_any",
           "mx_moe_packed_grouped", "mx_moe_packed_triton", "takes_gemv"]

ACTIVATIONS = (None, "mxfp8")
# op mx_moe's triton_grouped hands a call to the token-centric kernels while its (token, slot) pairs number at most
# this share of the experts: each touched expert then has about 1.3 pairs or fewer, which the GEMVs re-read for less
# than the grouped kernels' tiles cost. On an H100 (2026-12-07, benchmarks/mx_moe_layer.py --experts 384 --graphs,
# top-16) the token-centric kernels ran 1 to 16 tokens (pairs 4% to 67% of the experts) in 0.64x to 0.89x the grouped
# kernels' time, and 64 tokens (267%) in 1.86x
GEMV_MAX_PAIRS_PER_EXPERT = 0.75


def takes_gemv(tokens: int, k: int, experts: int, gemv_tokens: int | None = None) -> bool:
    """Whether :func:`mx_moe_packed_grouped` runs `tokens` tokens of top-`k` routing over `experts` experts on the
    token-centric kernels: up to `gemv_tokens` tokens when given (0: never), else while tokens * k is at most
    GEMV_MAX_PAIRS_PER_EXPERT of the experts."""
    if gemv_tokens is not None:
        if isinstance(gemv_tokens, bool) or not isinstance(gemv_tokens, int) or gemv_tokens < 0:
            raise ValueError(f"gemv_tokens={gemv_tokens!r} must be a non-negative int or None")
        return tokens <= gemv_tokens
    return tokens * k <= GEMV_MAX_PAIRS_PER_EXPERT * experts


# triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None


class PackedExpertWeights(tuple):
    """(w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale) of E stacked experts: uint8 [E, F, L/2],
    [E, F, L/32], the same for w3, [E, L, F/2], [E, L, F/32]."""

    __slots__ = ()

    def __new__(cls, w1p, w1s, w3p, w3s, w2p, w2s):
        return super().__new__(cls, (w1p, w1s, w3p, w3s, w2p, w2s))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, F, L)."""
        E, F, half = self[0].shape
        return E, F, 2 * half


def _check(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, activations) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} is invalid: use one of {ACTIVATIONS}")
    if z.ndim != 2 or not z.dtype.is_floating_point:
        raise ValueError(f"z must be a floating [N, L] tensor, got shape {tuple(z.shape)} dtype {z.dtype}")
    if len(w) != 6 or any(not isinstance(t, Tensor) or t.dtype != torch.uint8 for t in w):
        raise ValueError("the packed experts must be six uint8 tensors (w1, w3, w2: packed codes and scales)")
    w1p, w1s, w3p, w3s, w2p, w2s = w
    if w1p.ndim != 3:
        raise ValueError(f"w1_packed must be [E, F, L/2], got shape {tuple(w1p.shape)}")
    E, F, L = w.shape
    N = z.shape[0]
    if z.shape[1] != L:
        raise ValueError(f"z has {z.shape[1]} columns, the experts' latent width is {L}")
    if L % MX_BLOCK or F % MX_BLOCK:
        raise ValueError(f"MXFP4 experts need the latent width ({L}) and the expert width ({F}) to be multiples of "
                         f"{MX_BLOCK}")
    want = {"w1_scale": (w1s, (E, F, L // MX_BLOCK)), "w3_packed": (w3p, (E, F, L // 2)),
            "w3_scale": (w3s, (E, F, L // MX_BLOCK)), "w2_packed": (w2p, (E, L, F // 2)),
            "w2_scale": (w2s, (E, L, F // MX_BLOCK))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if indices.ndim != 2 or indices.shape[0] != N or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices must be an integer [N={N}, k] tensor, got shape {tuple(indices.shape)} "
                         f"dtype {indices.dtype}")
    if weights.shape != indices.shape or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be a floating tensor of shape {tuple(indices.shape)} like indices, got "
                         f"shape {tuple(weights.shape)} dtype {weights.dtype}")


def mx_moe_packed(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, beta1: float, beta2: float,
                  activations: str | None = "mxfp8") -> Tensor:
    """Reference: ``u_n = sum_j p_nj E_{e_nj}(z_n)`` with each touched expert decoded just before its GEMMs.

    Args:
        z: [N, L] latent inputs; weights, indices: [N, k] (``Routing``); w: the packed experts; beta1, beta2:
            SiTU-GLU's caps; activations: "mxfp8" rounds each expert GEMM's input, None leaves them.
    Returns:
        u [N, L] in z's dtype (GEMMs in z's dtype, combine in fp32), as k3.ops.moe.moe_experts computes on the
        decoded weights.
    """
    _check(z, weights, indices, w, activations)
    w1p, w1s, w3p, w3s, w2p, w2s = w
    N, L = z.shape
    E = w1p.shape[0]
    dt = z.dtype
    a = mxfp8_fake_quantize if activations == "mxfp8" else (lambda x: x)
    flat_expert = indices.reshape(-1).long()
    counts = expert_load(flat_expert, E)  # also checks the range of indices
    order = torch.argsort(flat_expert, stable=True)
    token_of = torch.arange(N, device=z.device).repeat_interleave(indices.shape[1])[order]
    weight_of = weights.reshape(-1)[order].float()
    zq = a(z)
    u = torch.zeros(N, L, dtype=torch.float32, device=z.device)
    begin = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        tokens = token_of[begin:begin + count]
        x = zq[tokens]
        w1 = mxfp4_dequantize(w1p[e], w1s[e], dtype=dt)
        w3 = mxfp4_dequantize(w3p[e], w3s[e], dtype=dt)
        hidden = a(situ_glu(x @ w1.T, x @ w3.T, beta1, beta2).to(dt))
        y = hidden @ mxfp4_dequantize(w2p[e], w2s[e], dtype=dt).T
        u.index_add_(0, tokens, y.float() * weight_of[begin:begin + count, None])
        begin += count
    return u.to(dt)


# --- the token-centric Triton kernels ------------------------------------------------------------------------------
# Autotuned on a GPU: (rows of W per program, 32-column groups per step along the contracted dimension, warps). A
# decode step has few pairs: narrow row blocks multiply the programs so that enough loads are in flight
_TUNE_GEMV = ((16, 4, 4), (8, 8, 4), (32, 4, 4), (16, 8, 4), (8, 4, 2), (4, 16, 4), (32, 2, 4), (64, 2, 4))
_FIXED_GEMV = (16, 4, 4)  # without autotuning (a compiled launch with autotune=False)
_INTERPRET_GEMV = (16, 2, 4)  # Triton's interpreter (tiny test shapes)


def _gate_up_kernel(z_ptr, idx_ptr, w1p_ptr, w1s_ptr, w3p_ptr, w3s_ptr, h_ptr, L, F, LH, LS, beta1, beta2,
                    pairs_log2, K: tl.constexpr, BLOCK_F: tl.constexpr, GROUPS: tl.constexpr):
    """Program (pair p = n*K + j, block b of F): h[p, b] = SiTU-GLU(w1[e] z_n, w3[e] z_n) over rows b of the expert
    e = idx[p], decoding the packed rows in registers. Per step, GROUPS blocks of 32 columns: bytes [BLOCK_F,
    GROUPS, 16], each code times its column of z (the low nibble the even column, the high the odd: no interleave),
    summed per block, and the block's sum times its E8M0 scale (one multiply per 32 weights); fp32 throughout.
    LH = L/2, LS = L/32 (row lengths of codes and scales); `pairs_log2` only keys the autotuning."""
    p = tl.program_id(0).to(tl.int64)
    n = p // K
    e = tl.load(idx_ptr + p).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = f < F
    row = e * F + f.to(tl.int64)
    g = tl.arange(0, GROUPS)
    i = tl.arange(0, 16)
    acc1 = tl.full([BLOCK_F], 0.0, tl.float32)
    acc3 = tl.full([BLOCK_F], 0.0, tl.float32)
    for s0 in range(0, LS, GROUPS):
        grp = s0 + g  # the step's 32-column blocks
        gm = grp < LS
        col = grp[:, None] * 32 + 2 * i[None, :]  # [GROUPS, 16]: the even column of each byte
        xe = tl.load(z_ptr + n * L + col, mask=gm[:, None], other=0.0).to(tl.float32)[None, :, :]
        xo = tl.load(z_ptr + n * L + col + 1, mask=gm[:, None], other=0.0).to(tl.float32)[None, :, :]
        boff = row[:, None, None] * LH + (grp[:, None] * 16 + i[None, :])[None, :, :]
        bm = fm[:, None, None] & gm[None, :, None]
        soff = row[:, None] * LS + grp[None, :]
        sm = fm[:, None] & gm[None, :]
        b = tl.load(w1p_ptr + boff, mask=bm, other=0).to(tl.int32)
        s = tl.load(w1s_ptr + soff, mask=sm, other=127).to(tl.int32)
        # E2M1 code (sign, 2 exponent bits, 1 mantissa bit) in an fp16's sign, low exponent bits and top mantissa
        # bit: the value times 2^-14, exact (code 1, 0.5, the subnormal 2^-15); the 2^14 goes into the scale
        lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        d = tl.reduce(lo * xe + hi * xo, 2, _SUM)  # [BLOCK_F, GROUPS]
        # E8M0 2^(s - 127) from its bits (byte 0 the subnormal 2^-127, 255 NaN); the block's sum times 2^14 first
        sc = tl.where(s == 0, 4194304, s << 23).to(tl.float32, bitcast=True)
        acc1 += tl.reduce((d * 16384.0) * tl.where(s == 255, float("nan"), sc), 1, _SUM)
        b = tl.load(w3p_ptr + boff, mask=bm, other=0).to(tl.int32)
        s = tl.load(w3s_ptr + soff, mask=sm, other=127).to(tl.int32)
        lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        d = tl.reduce(lo * xe + hi * xo, 2, _SUM)
        sc = tl.where(s == 0, 4194304, s << 23).to(tl.float32, bitcast=True)
        acc3 += tl.reduce((d * 16384.0) * tl.where(s == 255, float("nan"), sc), 1, _SUM)
    # SiTU-GLU in fp32 from exponentials of non-positive numbers (no overflow): tanh x = sign(x)(1 - e)/(1 + e),
    # e = exp(-2|x|), with the series x - x^3/3 + 2x^5/15 below |x| = 0.1 where 1 - e cancels.
    x1 = acc1 / beta1
    x2 = acc3 / beta2
    e1 = tl.exp2(tl.abs(x1) * -2.8853900817779268)
    e2 = tl.exp2(tl.abs(x2) * -2.8853900817779268)
    t1 = tl.where(x1 < 0, -1.0, 1.0) * (1.0 - e1) / (1.0 + e1)
    t2 = tl.where(x2 < 0, -1.0, 1.0) * (1.0 - e2) / (1.0 + e2)
    t1 = tl.where(tl.abs(x1) < 0.1, x1 - x1 * x1 * x1 / 3.0 + 2.0 * x1 * x1 * x1 * x1 * x1 / 15.0, t1)
    t2 = tl.where(tl.abs(x2) < 0.1, x2 - x2 * x2 * x2 / 3.0 + 2.0 * x2 * x2 * x2 * x2 * x2 / 15.0, t2)
    en = tl.exp2(tl.abs(acc1) * -1.4426950408889634)
    sig = tl.where(acc1 >= 0, 1.0 / (1.0 + en), en / (1.0 + en))
    hv = (beta1 * t1 * sig) * (beta2 * t2)
    tl.store(h_ptr + p * F + f, hv.to(h_ptr.dtype.element_ty), mask=fm)


def _down_kernel(h_ptr, idx_ptr, w2p_ptr, w2s_ptr, y_ptr, L, F, FH, FS, pairs_log2, BLOCK_F: tl.constexpr,
                 GROUPS: tl.constexpr):
    """Program (pair p, block b of L rows): y[p, b] = (w2[e] h[p])[b] for e = idx[p] (fp32, rounded to y's dtype
    as the reference rounds each expert's output), w2's rows decoded in registers as the gate/up kernel decodes
    (BLOCK_F names the rows of W per program, here rows of L); FH = F/2, FS = F/32."""
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(idx_ptr + p).to(tl.int64)
    r = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    rm = r < L
    row = e * L + r.to(tl.int64)
    g = tl.arange(0, GROUPS)
    i = tl.arange(0, 16)
    acc = tl.full([BLOCK_F], 0.0, tl.float32)
    for s0 in range(0, FS, GROUPS):
        grp = s0 + g
        gm = grp < FS
        col = grp[:, None] * 32 + 2 * i[None, :]
        he = tl.load(h_ptr + p * F + col, mask=gm[:, None], other=0.0).to(tl.float32)[None, :, :]
        ho = tl.load(h_ptr + p * F + col + 1, mask=gm[:, None], other=0.0).to(tl.float32)[None, :, :]
        b = tl.load(w2p_ptr + row[:, None, None] * FH + (grp[:, None] * 16 + i[None, :])[None, :, :],
                    mask=rm[:, None, None] & gm[None, :, None], other=0).to(tl.int32)
        s = tl.load(w2s_ptr + row[:, None] * FS + grp[None, :], mask=rm[:, None] & gm[None, :],
                    other=127).to(tl.int32)
        lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        d = tl.reduce(lo * he + hi * ho, 2, _SUM)
        sc = tl.where(s == 0, 4194304, s << 23).to(tl.float32, bitcast=True)
        acc += tl.reduce((d * 16384.0) * tl.where(s == 255, float("nan"), sc), 1, _SUM)
    tl.store(y_ptr + p * L + r, acc.to(y_ptr.dtype.element_ty), mask=rm)


@functools.lru_cache(maxsize=4)
def _kernels(interpret: bool, tune: bool):
    """The jitted kernels (per interpreter setting: ``triton.jit`` picks compiled or interpreted when it wraps the
    function); with `tune`, each autotuned over _TUNE_GEMV keyed by the shape and the pairs' log2 (every config
    writes the same outputs from the same inputs)."""
    import triton

    _triton.bind(globals())
    gate_up, down = triton.jit(_gate_up_kernel), triton.jit(_down_kernel)
    if not tune:
        return gate_up, down
    names = ("BLOCK_F", "GROUPS")
    return (_triton.autotuned(gate_up, _TUNE_GEMV, names, ["L", "F", "K", "pairs_log2"]),
            _triton.autotuned(down, _TUNE_GEMV, names, ["L", "F", "pairs_log2"]))


def mx_moe_packed_triton(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, beta1: float,
                         beta2: float, activations: str | None = "mxfp8", autotune: bool | None = None,
                         pairs: bool = False) -> Tensor:
    """:func:`mx_moe_packed` on the token-centric kernels (see the module docstring): gate/up and down per (token,
    slot) pair, then the fp32 combine of k3.ops.moe_combine over the pairs in token order. No host sync: the expert
    indices are read by the kernels (their range is not checked: on the router's output they are valid).
    `autotune`: None tunes the block sizes when compiled. With `pairs`, no combine: the down kernel's y [N*k, L]
    (pairs in token order, rounded to z's dtype as each expert's output is) for a kernel that combines them itself
    (op ``moe_combine_norm_out``)."""
    _check(z, weights, indices, w, activations)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MXFP4 expert kernels cannot run: {why}")
    N, L = z.shape
    k = indices.shape[1]
    E, F, _ = w.shape
    M = N * k
    y = torch.empty(M, L, device=z.device, dtype=z.dtype)
    if N == 0:
        return y if pairs else torch.empty(0, L, device=z.device, dtype=z.dtype)
    zq = (mxfp8_fake_quantize_any(z) if activations == "mxfp8" else z).contiguous()  # bit-exact, one kernel
    idx = indices.contiguous()
    h = torch.empty(M, F, device=z.device, dtype=z.dtype)
    interpret = _triton.interpret()
    tune = not interpret if autotune is None else autotune
    gate_up, down = _kernels(interpret, tune)
    if tune:
        fixed = {}
    else:
        bf, groups, warps = _INTERPRET_GEMV if interpret else _FIXED_GEMV
        fixed = dict(BLOCK_F=bf, GROUPS=groups, num_warps=warps)
    w1p, w1s, w3p, w3s, w2p, w2s = (t.contiguous() for t in w)
    pairs_log2 = (M - 1).bit_length()
    with torch.cuda.device(z.device.index if z.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        gate_up[lambda meta: (M, -(-F // meta["BLOCK_F"]))](
            zq, idx, w1p, w1s, w3p, w3s, h, L, F, L // 2, L // MX_BLOCK, float(beta1), float(beta2), pairs_log2,
            K=k, **fixed)
        if activations == "mxfp8":
            h = mxfp8_fake_quantize_any(h).contiguous()
        down[lambda meta: (M, -(-L // meta["BLOCK_F"]))](h, idx, w2p, w2s, y, L, F, F // 2, F // MX_BLOCK,
                                                         pairs_log2, **fixed)
    if pairs:
        return y
    return moe_combine(y, torch.arange(M, device=z.device), weights, z.dtype)


def mx_moe_packed_grouped(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, beta1: float,
                          beta2: float, activations: str | None = "mxfp8", decode: str = "auto",
                          block_t: int | None = None, autotune: bool | None = None,
                          gemv_tokens: int | None = None) -> Tensor:
    """:func:`mx_moe_packed` on the expert-centric grouped kernels (k3.ops.mx_moe_grouped): each touched expert's
    packed rows read once per tile of up to `block_t` of its tokens (None: 16 at decode, up to 64 in prefill), no
    host sync; a decode step's few tokens take the token-centric kernels instead (:func:`mx_moe_packed_triton`, where
    :func:`takes_gemv` says: nearly every pair has an expert of its own there, which a GEMV streams and a tile of one
    real row wastes the matrix unit on); `gemv_tokens` overrides that (at most that many tokens; 0: never).
    `decode` (the grouped kernels'): "dot_scaled" (Triton's MX dot, bf16/fp16 inputs), "registers" (our decode, any
    dtype), "bits" (bf16 tokens: the weights' bf16 bits by integer operations), "nibbles" (any dtype: per scale
    block, low nibbles against even columns and high against odd, the sums scaled once) or "auto" (registers:
    faster than dot_scaled on an H100); `autotune`: None tunes the block sizes when compiled.
    The expert indices are not range-checked on CUDA (on the router's output they are valid)."""
    _check(z, weights, indices, w, activations)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MXFP4 expert kernels cannot run: {why}")
    if takes_gemv(z.shape[0], indices.shape[1], w.shape[0], gemv_tokens):
        return mx_moe_packed_triton(z, weights, indices, w, beta1, beta2, activations, autotune=autotune)
    return grouped_experts(z, weights, indices, w, beta1, beta2, activations, decode=decode, block_t=block_t,
                           autotune=autotune)


# ``auto`` takes the first implementation that is available and validated (k3.ops.registry). The grouped backend is
# validated (GPU tests passed on an H100, 2026-12-06 and -07, the token-centric kernels it hands a decode step to
# included, captured in a CUDA graph) and faster than the dequantized bf16 experts at 1 to 64 release-shaped tokens,
# so ``auto`` runs it on CUDA and k3.checkpoint keeps MXFP4 checkpoints packed (its "auto" packs where op mx_moe runs
# on a kernel). ``triton`` alone (the token-centric kernels at every size, re-reading an expert per pair in prefill)
# stays unvalidated; ``fast`` and ``--backend fast`` take it, the first.
register(Op(
    "mx_moe", reference=mx_moe_packed,
    fast=(Fast("triton", mx_moe_packed_triton, _triton.available, validated=False, cpu=True),
          Fast("triton_grouped", mx_moe_packed_grouped, _triton.available, validated=True, cpu=True)),
    tolerance="fp32: 1e-5 of the largest output entry (fp32 accumulation in another order, SiTU-GLU's tanh from "
              "exponentials); bf16: 2e-2 relative (the reference rounds each GEMM's output to bf16, the kernels "
              "keep fp32 until the output)"))


def mx_moe_packed_any(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, beta1: float,
                      beta2: float, activations: str | None = "mxfp8", backends: Backends | None = None) -> Tensor:
    """The packed MXFP4 experts on the implementation the registry picks for z (op ``mx_moe``)."""
    return dispatch("mx_moe", z, backends).fn(z, weights, indices, w, beta1, beta2, activations)
