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
* ``triton`` (:func:`mx_moe_packed_triton`): token-centric kernels in the spirit of WarpDecode (§5.4.2), for
  decode's few tokens: one program per (token, slot, block of F rows) decodes its rows of w1 and w3 from the
  packed bytes in registers, accumulates both projections in fp32 and applies SiTU-GLU; a second kernel, one
  program per (token, block of L rows), decodes w2's rows, applies them to the hidden of each of the token's k
  experts and sums with the routing weights in fp32 (the combine is fused). Nothing dense is ever written: the
  bytes read are the packed rows of the experts actually touched. The MXFP8 rounding of z and of the hidden
  runs between the kernels (k3.ops.mx's encoder). Each token reads its experts' weights itself, so for prefill
  (many tokens per expert) this form re-reads weights per token; a grouped MXFP4 kernel for prefill is not
  written yet. Its GPU tests pass on an H200, but at one release-shaped layer it is slower than the dequantized
  bf16 grouped GEMMs (1.56 vs 0.94 ms at 1 token, 47 vs 14 ms at 64: 9-15% of its bytes-touched floor,
  BENCHMARKS.md), so ``auto`` never takes it; ``--backend fast`` or ``K3_MX_MOE_BACKEND=triton`` selects it (a quarter of the memory). ``TRITON_INTERPRET=1``
  runs it on CPU tensors (the tests).
* ``triton_grouped`` (:func:`mx_moe_packed_grouped`, kernels in k3.ops.mx_moe_grouped): expert-centric, for decode
  and prefill alike: the (token, slot) pairs sorted by expert and cut into tiles of up to 16-64 rows of one expert;
  one program per (tile, block of output rows) reads the expert's packed rows once for the whole tile, decodes them
  in registers (Triton's ``tl.dot_scaled`` for bf16/fp16 inputs, or its own decode) and multiplies on the matrix
  units with fp32 accumulation; SiTU-GLU in the gate/up epilogue, per-(token, slot) outputs from the down kernel,
  then the deterministic fp32 combine of k3.ops.moe_combine. No host sync (CUDA graphs can capture it). Validated:
  its GPU tests (1, 16, 64 and 512 tokens, and the capture in a CUDA graph) passed on an H100 (2026-12-06), where it
  ran a release-shaped layer faster than the dequantized bf16 experts at 1, 16 and 64 tokens (1.04x, 1.19x, 1.21x).

The choice (k3.ops.registry): ``auto`` takes the first implementation that is available and validated. The
token-centric kernels stay unvalidated (slower than bf16), so ``auto`` runs ``triton_grouped`` on CUDA, and the
inference commands keep MXFP4 checkpoints packed there (k3.checkpoint packs where op ``mx_moe`` runs on a kernel);
on CPU ``auto`` keeps the reference, which decodes at load. ``fast`` names the first, the token-centric kernels.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.moe import expert_load
from k3.ops.mx import MX_BLOCK, mxfp4_dequantize, mxfp8_fake_quantize
from k3.ops.mx_moe_grouped import grouped_experts
from k3.ops.registry import Backends, Fast, Op, dispatch, register
from k3.ops.situ import situ_glu

__all__ = ["ACTIVATIONS", "PackedExpertWeights", "mx_moe_packed", "mx_moe_packed_any", "mx_moe_packed_grouped",
           "mx_moe_packed_triton"]

ACTIVATIONS = (None, "mxfp8")
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
def _gate_up_kernel(z_ptr, idx_ptr, w1p_ptr, w1s_ptr, w3p_ptr, w3s_ptr, h_ptr, L, F, beta1, beta2,
                    K: tl.constexpr, BLOCK_F: tl.constexpr, HALF: tl.constexpr):
    """Program (pair p = n*K + j, block b of F): h[p, b] = SiTU-GLU(w1[e] z_n, w3[e] z_n) over rows b of the expert
    e = idx[p], decoding the packed rows in registers; fp32 accumulation over L in chunks of 2*HALF columns."""
    p = tl.program_id(0).to(tl.int64)
    n = p // K
    e = tl.load(idx_ptr + p).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fm = f < F
    i = tl.arange(0, HALF)
    row = (e * F + f.to(tl.int64))[:, None]
    acc1 = tl.full([BLOCK_F], 0.0, tl.float32)
    acc3 = tl.full([BLOCK_F], 0.0, tl.float32)
    for l0 in range(0, L, 2 * HALF):
        col = l0 + 2 * i  # the even column of each byte
        cm = col < L
        xe = tl.load(z_ptr + n * L + col, mask=cm, other=0.0).to(tl.float32)[None, :]
        xo = tl.load(z_ptr + n * L + col + 1, mask=cm, other=0.0).to(tl.float32)[None, :]
        m2 = fm[:, None] & cm[None, :]
        boff = row * (L // 2) + (l0 // 2 + i)[None, :]
        soff = row * (L // 32) + (col // 32)[None, :]
        b1 = tl.load(w1p_ptr + boff, mask=m2, other=0).to(tl.int32)
        s1 = tl.load(w1s_ptr + soff, mask=m2, other=127).to(tl.int32)
        b3 = tl.load(w3p_ptr + boff, mask=m2, other=0).to(tl.int32)
        s3 = tl.load(w3s_ptr + soff, mask=m2, other=127).to(tl.int32)
        # E2M1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6) of index m: m/2 below 4, m - 2 below 6, 2m - 8 above
        lo1 = b1 & 15
        hi1 = b1 >> 4
        lo3 = b3 & 15
        hi3 = b3 >> 4
        m = (lo1 & 7).to(tl.float32)
        vlo1 = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
        vlo1 = tl.where((lo1 & 8) != 0, -vlo1, vlo1)
        m = (hi1 & 7).to(tl.float32)
        vhi1 = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
        vhi1 = tl.where((hi1 & 8) != 0, -vhi1, vhi1)
        m = (lo3 & 7).to(tl.float32)
        vlo3 = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
        vlo3 = tl.where((lo3 & 8) != 0, -vlo3, vlo3)
        m = (hi3 & 7).to(tl.float32)
        vhi3 = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
        vhi3 = tl.where((hi3 & 8) != 0, -vhi3, vhi3)
        sc1 = tl.exp2((s1 - 127).to(tl.float32))
        sc3 = tl.exp2((s3 - 127).to(tl.float32))
        acc1 += tl.reduce((vlo1 * sc1) * xe + (vhi1 * sc1) * xo, 1, _SUM)
        acc3 += tl.reduce((vlo3 * sc3) * xe + (vhi3 * sc3) * xo, 1, _SUM)
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


def _down_kernel(h_ptr, idx_ptr, w_ptr, w2p_ptr, w2s_ptr, u_ptr, L, F, K: tl.constexpr, BLOCK_L: tl.constexpr,
                 HALF: tl.constexpr):
    """Program (token n, block b of L): u[n, b] = sum_j w[n, j] (w2[e_nj] h[n*K + j])[b], decoding w2's rows in
    registers, fp32 throughout (the combine fused)."""
    n = tl.program_id(0).to(tl.int64)
    lrow = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    lm = lrow < L
    i = tl.arange(0, HALF)
    out = tl.full([BLOCK_L], 0.0, tl.float32)
    for j in range(K):
        e = tl.load(idx_ptr + n * K + j).to(tl.int64)
        wt = tl.load(w_ptr + n * K + j).to(tl.float32)
        row = (e * L + lrow.to(tl.int64))[:, None]
        acc = tl.full([BLOCK_L], 0.0, tl.float32)
        for f0 in range(0, F, 2 * HALF):
            col = f0 + 2 * i
            cm = col < F
            he = tl.load(h_ptr + (n * K + j) * F + col, mask=cm, other=0.0).to(tl.float32)[None, :]
            ho = tl.load(h_ptr + (n * K + j) * F + col + 1, mask=cm, other=0.0).to(tl.float32)[None, :]
            m2 = lm[:, None] & cm[None, :]
            b = tl.load(w2p_ptr + row * (F // 2) + (f0 // 2 + i)[None, :], mask=m2, other=0).to(tl.int32)
            s = tl.load(w2s_ptr + row * (F // 32) + (col // 32)[None, :], mask=m2, other=127).to(tl.int32)
            lo = b & 15
            hi = b >> 4
            m = (lo & 7).to(tl.float32)
            vlo = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
            vlo = tl.where((lo & 8) != 0, -vlo, vlo)
            m = (hi & 7).to(tl.float32)
            vhi = tl.where(m < 4.0, m * 0.5, tl.where(m < 6.0, m - 2.0, m * 2.0 - 8.0))
            vhi = tl.where((hi & 8) != 0, -vhi, vhi)
            scale = tl.exp2((s - 127).to(tl.float32))
            acc += tl.reduce((vlo * scale) * he + (vhi * scale) * ho, 1, _SUM)
        out += wt * acc
    tl.store(u_ptr + n * L + lrow, out.to(u_ptr.dtype.element_ty), mask=lm)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_gate_up_kernel), triton.jit(_down_kernel)


def mx_moe_packed_triton(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, beta1: float,
                         beta2: float, activations: str | None = "mxfp8") -> Tensor:
    """:func:`mx_moe_packed` on the token-centric Triton kernels (see the module docstring). No host sync: the
    expert indices are read by the kernels (their range is not checked: on the router's output they are valid)."""
    _check(z, weights, indices, w, activations)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MXFP4 expert kernels cannot run: {why}")
    N, L = z.shape
    k = indices.shape[1]
    E, F, _ = w.shape
    u = torch.empty(N, L, device=z.device, dtype=z.dtype)
    if N == 0:
        return u
    zq = (mxfp8_fake_quantize(z) if activations == "mxfp8" else z).contiguous()
    idx = indices.contiguous()
    h = torch.empty(N * k, F, device=z.device, dtype=z.dtype)
    gate_up, down = _kernels(_triton.interpret())
    w1p, w1s, w3p, w3s, w2p, w2s = (t.contiguous() for t in w)
    block_f, block_l, half = 32, 32, 64
    with torch.cuda.device(z.device.index if z.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        gate_up[(N * k, -(-F // block_f))](zq, idx, w1p, w1s, w3p, w3s, h, L, F, float(beta1), float(beta2),
                                           K=k, BLOCK_F=block_f, HALF=half, num_warps=4)
        if activations == "mxfp8":
            h = mxfp8_fake_quantize(h).contiguous()
        down[(N, -(-L // block_l))](h, idx, weights.contiguous(), w2p, w2s, u, L, F, K=k, BLOCK_L=block_l,
                                    HALF=half, num_warps=4)
    return u


def mx_moe_packed_grouped(z: Tensor, weights: Tensor, indices: Tensor, w: PackedExpertWeights, beta1: float,
                          beta2: float, activations: str | None = "mxfp8", decode: str = "auto",
                          block_t: int | None = None, autotune: bool | None = None) -> Tensor:
    """:func:`mx_moe_packed` on the expert-centric grouped kernels (k3.ops.mx_moe_grouped): each touched expert's
    packed rows read once per tile of up to `block_t` of its tokens (None: 16 at decode, up to 64 in prefill), no
    host sync. `decode`: "dot_scaled" (Triton's MX dot, bf16/fp16 inputs), "registers" (our decode, any dtype),
    "bits" (bf16 tokens: the weights' bf16 bits by integer operations) or "auto" (registers: faster than dot_scaled
    on an H100); `autotune`: None tunes the block sizes when compiled.
    The expert indices are not range-checked on CUDA (on the router's output they are valid)."""
    _check(z, weights, indices, w, activations)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MXFP4 expert kernels cannot run: {why}")
    return grouped_experts(z, weights, indices, w, beta1, beta2, activations, decode=decode, block_t=block_t,
                           autotune=autotune)


# ``auto`` takes the first implementation that is available and validated (k3.ops.registry): the token-centric
# kernels stay unvalidated (slower than the dequantized bf16 experts), the grouped ones are validated (GPU tests passed
# on an H100, 2026-12-06, and faster than bf16 at 1, 16 and 64 tokens), so ``auto`` runs them on CUDA and
# k3.checkpoint keeps MXFP4 checkpoints packed (its "auto" packs where op mx_moe runs on a kernel). ``fast`` and
# ``--backend fast`` take the first, the token-centric kernels, as before.
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
