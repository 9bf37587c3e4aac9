"""Expert-centric grouped kernels for the routed experts in MXFP4 storage (op ``mx_moe``, backend ``triton_grouped``).

The token-centric kernels of k3.ops.mx_moe give every (token, expert) pair its own programs, so an expert routed
16 tokens has its packed rows read 16 times. Here the N*k (token, slot) pairs are sorted by expert (a stable
argsort, as the bf16 grouped path of k3.ops.moe does) and cut into tiles of at most BLOCK_T rows of one expert;
one program per (tile, block of output rows) reads that expert's packed rows once and multiplies them with the
whole tile of tokens:

* gate/up: program (tile, block of BLOCK_F rows of F) decodes rows of w1 and w3 ([BLOCK_F, BLOCK_K] per step
  along L) and takes ``W @ X^T`` against the tile's latent rows ``X`` [BLOCK_T, BLOCK_K] (gathered by token),
  fp32 accumulation; the epilogue applies SiTU-GLU and writes the hidden rows in expert order;
* down: program (tile, block of BLOCK_L rows of L) does the same with w2 against the tile's hidden rows and writes
  each (token, slot)'s output row y [N*k, L] in fp32, in expert order;
* combine: ``u[n] = sum_j p_nj y[pos(n, j)]`` in fp32 by k3.ops.moe_combine (op ``moe_combine``: one Triton kernel
  on CUDA, a row of y read once), the same reduction the bf16 grouped path uses. The combine is a separate pass, not
  atomic adds in the down kernel's epilogue: atomics would sum a token's k expert outputs in whatever order the
  programs finish, so the output would change from run to run; the extra traffic (y written and read once: 14.7 MB
  at 64 release-shaped tokens) is small against the packed weights (10.9 GB for those tokens).

The weights are the left operand (rows of W against the tile's tokens: the "swap AB" form for small batches), so
the wide dimension of W fills the matrix unit and BLOCK_T can be as small as 16 at decode. Three ways to decode:

* ``dot_scaled`` (bf16 or fp16 inputs): ``tl.dot_scaled`` with the packed codes and E8M0 scales as they are stored
  (e2m1, k-packed: byte j of a row holds columns 2j and 2j+1, low nibble first, as k3.ops.mx) and the tokens in
  bf16/fp16; Triton's compiler decodes the codes into bf16 in registers (on Hopper, then a bf16 MMA; natively on
  GPUs with MX instructions);
* ``registers`` (any float dtype; fp32 takes IEEE fp32 dots, ``input_precision="ieee"``): our own decode, the
  E2M1 value ``m/2, m - 2, 2m - 8`` of the magnitude index times the E8M0 power of two built from its bits
  (2^-127 for byte 0, NaN for 255, as k3.ops.mx_dequantize), exact in fp32; the low and high nibbles of byte j
  become columns 2j and 2j + 1 in registers (a join of the two). ``auto`` takes this one: on an H100 (2026-12-06,
  benchmarks/mx_moe_layer.py) it ran a release-shaped layer in 0.93, 4.58 and 11.96 ms at 1, 16 and
  64 tokens against dot_scaled's 1.04, 5.36 and 14.06 ms;
* ``bits`` (bf16 tokens): the decoded weights' bf16 bits built by integer operations alone, without the two
  float conversions and two multiplies per weight of ``registers``. Conversions run at a quarter of the integer
  rate on Hopper, and at 64 release-shaped tokens the ``registers`` kernels stream their weights at 0.9 TB/s where
  the bf16 GEMMs reach 2.8: probably the decode, not the memory, bounds them. For code c
  (sign bit 8, magnitude m = c & 7: exponent bits e = m >> 1, mantissa bit m & 1) and E8M0 byte s, the value
  E2M1(m) * 2^(s - 127) is a normal bf16 with exponent field s + e - 1 and mantissa bit 6 the code's, except code
  1 (0.5: exponent field s - 1, no mantissa bit) and magnitude 0 (zero): ((s - 1) << 7) + (m << 6), less 64 for
  m = 1, with the sign at bit 15. That holds for every scale in [2, 252]; a step whose rows hold a scale outside
  (subnormal or infinite results, NaN) takes the ``registers`` decode, so every scale decodes exactly as
  k3.ops.mx.mxfp4_dequantize. Not ``auto``'s choice until measured faster on a GPU.
* ``nibbles`` (any float dtype): no scale multiplied into a weight and no interleave. Per 32-column scale block,
  the low nibbles of the block's 16 bytes per row are multiplied with the tokens' even columns and the high nibbles
  with the odd ones (two dots of depth 16), and the block's sums [rows, BLOCK_T] are scaled once by the E8M0 scale:
  a multiply per (row, token) instead of per weight. A code becomes an fp16 by moving its bits (value times 2^-14,
  exact: code 1 is the subnormal 2^-15; the scale carries the 2^14), then the tokens' dtype (exact in bf16). The
  per-weight work is six integer operations and a conversion, against ``registers``' two conversions, two
  multiplies and the join of the two nibbles' columns, yet on an H100 (2026-12-07, release-shaped layer) it ran 5-9%
  slower than ``registers`` (0.42, 3.71 and 6.98 ms at 1, 16 and 64 tokens against 0.39, 3.54 and 6.57): with
  ``bits`` slower too, the per-weight arithmetic is not what bounds these kernels. Not ``auto``'s choice.

Nothing reads back to the host: the tile map is built on the device (counts by index_add, cumsums, searchsorted)
for a grid sized by its upper bound ``min(E, N*k) + N*k // BLOCK_T`` tiles, and programs past the last tile do
nothing; experts with no tokens get no tile. So a decode step with these kernels can be captured in a CUDA graph.
BLOCK_T is picked on the host from the mean pairs per expert (16 at decode, up to 64 in prefill); the other block
sizes, warps and stages are autotuned per shape on a GPU (Triton's interpreter runs one fixed small config).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.moe_combine import moe_combine
from k3.ops.mx import mxfp8_fake_quantize_any

__all__ = ["DECODES", "grouped_experts", "tile_map"]

DECODES = ("auto", "dot_scaled", "registers", "bits", "nibbles")
# triton.language, bound on first use (k3.ops._triton.bind)
tl = None

# Autotuned on a GPU, per kernel: (rows of W per program, columns of the contracted dimension per step, warps,
# stages). Few, as each compiles per decode and BLOCK_T (seconds each), and chosen among those that Triton compiles
# for sm_90 without spilling registers at BLOCK_T 16 and 32 (the larger tiles need more warps: two accumulators
# and the decoded rows of w1 and w3 live in registers at once in gate/up)
_TUNE_GATE_UP = ((32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (32, 256, 4, 3),
                 (64, 256, 8, 3))
_TUNE_DOWN = ((32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (64, 256, 4, 4), (128, 128, 8, 3),
              (128, 256, 8, 3))
# Without autotuning: one config compiled, one small one in Triton's interpreter (tiny test shapes; it is slow)
_FIXED_CONFIG = (64, 128, 4, 3)
_INTERPRET_CONFIG = (32, 64, 4, 1)


def _gate_up_kernel(z_ptr, order_ptr, tile_ptr, w1p_ptr, w1s_ptr, w3p_ptr, w3s_ptr, h_ptr, L, LH, LS, F, beta1,
                    beta2, tiles_log2, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_SCALED: tl.constexpr, FMT: tl.constexpr,
                    IEEE: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr):
    """Program (tile t, block b of F): h[rows of t, b] = SiTU-GLU(w1[e] x, w3[e] x) for the tile's tokens x and its
    expert e, w1/w3 rows decoded once for all of them; fp32 accumulation. LH = L/2 and LS = L/32 (row lengths of
    the codes and scales, passed so that Triton sees their divisibility); EVEN_K: BLOCK_K divides L (no column
    masks); BITS: bf16 tokens, the weights' bf16 bits built by integer operations where the step's scales allow
    (the module docstring); NIBBLES: the ``nibbles`` decode (per scale block, the low and high nibbles against the
    even and odd columns, the block's sums scaled once); `tiles_log2` only keys the autotuning."""
    t = tl.program_id(0)
    e = tl.load(tile_ptr + 3 * t).to(tl.int64)  # -1: past the last tile
    if e >= 0:
        row0 = tl.load(tile_ptr + 3 * t + 1)
        row1 = tl.load(tile_ptr + 3 * t + 2)  # end of this expert's rows
        r = row0 + tl.arange(0, BLOCK_T)
        rm = r < row1
        tok = (tl.load(order_ptr + r, mask=rm, other=0) // K).to(tl.int64)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm = f < F
        wrow = (e * F + f.to(tl.int64))[:, None]
        acc1 = tl.full([BLOCK_F, BLOCK_T], 0.0, tl.float32)
        acc3 = tl.full([BLOCK_F, BLOCK_T], 0.0, tl.float32)
        for l0 in range(0, L, BLOCK_K):
            if NIBBLES:  # per scale block: low nibbles x even columns + high x odd, the sums scaled once
                for g in tl.static_range(BLOCK_K // 32):
                    c0 = l0 + g * 32
                    jn = c0 // 2 + tl.arange(0, 16)
                    cn = c0 + 2 * tl.arange(0, 16)
                    sn1 = c0 // 32 + tl.full([1], 0, tl.int32)  # the block's scale column
                    wm = fm[:, None] & (jn < LH)[None, :]
                    sm = fm[:, None] & (sn1 < LS)[None, :]
                    xm = rm[None, :] & (cn < L)[:, None]
                    xe = tl.load(z_ptr + tok[None, :] * L + cn[:, None], mask=xm, other=0.0)  # [16, BLOCK_T]
                    xo = tl.load(z_ptr + tok[None, :] * L + (cn + 1)[:, None], mask=xm, other=0.0)
                    for which in tl.static_range(2):  # w1, then w3
                        if which == 0:
                            bn = tl.load(w1p_ptr + wrow * LH + jn[None, :], mask=wm, other=0).to(tl.int32)
                            sn = tl.load(w1s_ptr + wrow * LS + sn1[None, :], mask=sm, other=127).to(tl.int32)
                        else:
                            bn = tl.load(w3p_ptr + wrow * LH + jn[None, :], mask=wm, other=0).to(tl.int32)
                            sn = tl.load(w3s_ptr + wrow * LS + sn1[None, :], mask=sm, other=127).to(tl.int32)
                        # codes as fp16 (value x 2^-14, exact, no float operation; the module docstring)
                        lo = (((bn & 8) << 12) | ((bn & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
                        hi = (((bn & 128) << 8) | ((bn & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
                        # E8M0 2^(s - 127) times the 2^14 left out of the codes (byte 0: 2^-127; 255: NaN)
                        sc = tl.where(sn == 0, 4194304, sn << 23).to(tl.float32, bitcast=True)
                        sc = tl.where(sn == 255, float("nan"), sc) * 16384.0  # [BLOCK_F, 1]
                        if IEEE:
                            part = tl.dot(lo.to(tl.float32), xe.to(tl.float32), input_precision="ieee")
                            part = tl.dot(hi.to(tl.float32), xo.to(tl.float32), part, input_precision="ieee")
                        else:
                            part = tl.dot(lo.to(xe.dtype), xe)
                            part = tl.dot(hi.to(xo.dtype), xo, part)
                        if which == 0:
                            acc1 += part * sc
                        else:
                            acc3 += part * sc
            else:
                c = l0 + tl.arange(0, BLOCK_K)  # columns of the step
                jb = l0 // 2 + tl.arange(0, BLOCK_K // 2)  # their bytes
                sb = l0 // 32 + tl.arange(0, BLOCK_K // 32)  # their scales
                if EVEN_K:
                    xm = rm[None, :]
                    wm = fm[:, None]
                    sm = fm[:, None]
                else:
                    xm = (c < L)[:, None] & rm[None, :]
                    wm = fm[:, None] & (jb < LH)[None, :]
                    sm = fm[:, None] & (sb < LS)[None, :]
                x = tl.load(z_ptr + tok[None, :] * L + c[:, None], mask=xm, other=0.0)  # [BLOCK_K, BLOCK_T]
                b1 = tl.load(w1p_ptr + wrow * LH + jb[None, :], mask=wm, other=0)  # [BLOCK_F, BLOCK_K / 2]
                s1 = tl.load(w1s_ptr + wrow * LS + sb[None, :], mask=sm, other=127)  # [BLOCK_F, BLOCK_K / 32]
                b3 = tl.load(w3p_ptr + wrow * LH + jb[None, :], mask=wm, other=0)
                s3 = tl.load(w3s_ptr + wrow * LS + sb[None, :], mask=sm, other=127)
                if DOT_SCALED:
                    acc1 = tl.dot_scaled(b1, s1, "e2m1", x, None, FMT, acc1)
                    acc3 = tl.dot_scaled(b3, s3, "e2m1", x, None, FMT, acc3)
                else:
                    q1 = s1.to(tl.int32)  # defined on both branches (a compiled kernel's names must be)
                    q3 = s3.to(tl.int32)
                    if BITS:  # every scale of the step's rows in [2, 252]: no bf16 result subnormal or infinite
                        odd = (q1 < 2) | (q1 > 252) | (q3 < 2) | (q3 > 252)
                        edge = tl.reduce(tl.reduce(odd.to(tl.int32), 1, _MAX), 0, _MAX)
                    else:
                        edge = 1
                    if edge == 0:
                        # the bf16 bits of value * 2^(s - 127) by integer operations (the module docstring)
                        b = b1.to(tl.int32)
                        cd = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_F, BLOCK_K))  # codes of columns 2j, 2j+1
                        m = cd & 7
                        base = tl.reshape(tl.broadcast_to(((q1 - 1) << 7)[:, :, None], (BLOCK_F, BLOCK_K // 32, 32)),
                                          (BLOCK_F, BLOCK_K))
                        v = tl.where(m == 0, 0, (base + (m << 6) - ((m == 1).to(tl.int32) << 6)) | ((cd & 8) << 12))
                        w1 = v.to(tl.int16).to(tl.bfloat16, bitcast=True).to(x.dtype)
                        b = b3.to(tl.int32)
                        cd = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_F, BLOCK_K))
                        m = cd & 7
                        base = tl.reshape(tl.broadcast_to(((q3 - 1) << 7)[:, :, None], (BLOCK_F, BLOCK_K // 32, 32)),
                                          (BLOCK_F, BLOCK_K))
                        v = tl.where(m == 0, 0, (base + (m << 6) - ((m == 1).to(tl.int32) << 6)) | ((cd & 8) << 12))
                        w3 = v.to(tl.int16).to(tl.bfloat16, bitcast=True).to(x.dtype)
                    else:
                        # E8M0 2^(s - 127) from its bits (byte 0 the subnormal 2^-127, 255 NaN), per 16 bytes of codes
                        s = s1.to(tl.int32)
                        sc = tl.where(s == 0, 4194304, s << 23).to(tl.float32, bitcast=True)
                        sc = tl.where(s == 255, float("nan"), sc)
                        sc1 = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_F, BLOCK_K // 32, 16)),
                                         (BLOCK_F, BLOCK_K // 2))
                        s = s3.to(tl.int32)
                        sc = tl.where(s == 0, 4194304, s << 23).to(tl.float32, bitcast=True)
                        sc = tl.where(s == 255, float("nan"), sc)
                        sc3 = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_F, BLOCK_K // 32, 16)),
                                         (BLOCK_F, BLOCK_K // 2))
                        # E2M1 code (sign, 2 exponent bits, 1 mantissa bit) moved into an fp16's sign, the low
                        # exponent bits and the top mantissa bit: that fp16 is the value times 2^-14 (code 1, 0.5,
                        # lands on the subnormal 2^-15), exact; times 2^14 and the scale in fp32, as
                        # k3.ops.mx.mxfp4_dequantize
                        b = b1.to(tl.int32)
                        lo = ((((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
                              .to(tl.float32) * 16384.0 * sc1)
                        hi = ((((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
                              .to(tl.float32) * 16384.0 * sc1)
                        w1 = tl.reshape(tl.join(lo.to(x.dtype), hi.to(x.dtype)), (BLOCK_F, BLOCK_K))  # columns 2j, 2j+1
                        b = b3.to(tl.int32)
                        lo = ((((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
                              .to(tl.float32) * 16384.0 * sc3)
                        hi = ((((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
                              .to(tl.float32) * 16384.0 * sc3)
                        w3 = tl.reshape(tl.join(lo.to(x.dtype), hi.to(x.dtype)), (BLOCK_F, BLOCK_K))
                    if IEEE:
                        acc1 = tl.dot(w1.to(tl.float32), x.to(tl.float32), acc1, input_precision="ieee")
                        acc3 = tl.dot(w3.to(tl.float32), x.to(tl.float32), acc3, input_precision="ieee")
                    else:  # the weights in the tokens' dtype (exact for bf16, as the reference decodes them)
                        acc1 = tl.dot(w1, x, acc1)
                        acc3 = tl.dot(w3, x, acc3)
        # SiTU-GLU in fp32 from exponentials of non-positive numbers, as k3.ops.mx_moe's token-centric kernel
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
        hv = (beta1 * t1 * sig) * (beta2 * t2)  # [BLOCK_F, BLOCK_T]
        tl.store(h_ptr + r.to(tl.int64)[None, :] * F + f[:, None], hv.to(h_ptr.dtype.element_ty),
                 mask=fm[:, None] & rm[None, :])


def _down_kernel(h_ptr, tile_ptr, w2p_ptr, w2s_ptr, y_ptr, L, F, FH, FS, tiles_log2, BLOCK_T: tl.constexpr,
                 BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_SCALED: tl.constexpr,
                 FMT: tl.constexpr, IEEE: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr):
    """Program (tile t, block b of L rows): y[rows of t, b] = w2[e] h for the tile's hidden rows (in expert order)
    and its expert e, w2's rows decoded once for all of them; fp32 throughout. BLOCK_F names the rows of W per
    program (here rows of L, so that both kernels share the autotuning configs); FH = F/2, FS = F/32; EVEN_K:
    BLOCK_K divides F; BITS and NIBBLES as in the gate/up kernel."""
    t = tl.program_id(0)
    e = tl.load(tile_ptr + 3 * t).to(tl.int64)
    if e >= 0:
        row0 = tl.load(tile_ptr + 3 * t + 1)
        row1 = tl.load(tile_ptr + 3 * t + 2)
        r = row0 + tl.arange(0, BLOCK_T)
        rm = r < row1
        r64 = r.to(tl.int64)
        lr = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        lm = lr < L
        wrow = (e * L + lr.to(tl.int64))[:, None]
        acc = tl.full([BLOCK_F, BLOCK_T], 0.0, tl.float32)
        for f0 in range(0, F, BLOCK_K):
            if NIBBLES:  # as in the gate/up kernel
                for g in tl.static_range(BLOCK_K // 32):
                    c0 = f0 + g * 32
                    jn = c0 // 2 + tl.arange(0, 16)
                    cn = c0 + 2 * tl.arange(0, 16)
                    sn1 = c0 // 32 + tl.full([1], 0, tl.int32)
                    wm = lm[:, None] & (jn < FH)[None, :]
                    sm = lm[:, None] & (sn1 < FS)[None, :]
                    xm = rm[None, :] & (cn < F)[:, None]
                    xe = tl.load(h_ptr + r64[None, :] * F + cn[:, None], mask=xm, other=0.0)
                    xo = tl.load(h_ptr + r64[None, :] * F + (cn + 1)[:, None], mask=xm, other=0.0)
                    bn = tl.load(w2p_ptr + wrow * FH + jn[None, :], mask=wm, other=0).to(tl.int32)
                    sn = tl.load(w2s_ptr + wrow * FS + sn1[None, :], mask=sm, other=127).to(tl.int32)
                    lo = (((bn & 8) << 12) | ((bn & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
                    hi = (((bn & 128) << 8) | ((bn & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
                    sc = tl.where(sn == 0, 4194304, sn << 23).to(tl.float32, bitcast=True)
                    sc = tl.where(sn == 255, float("nan"), sc) * 16384.0
                    if IEEE:
                        part = tl.dot(lo.to(tl.float32), xe.to(tl.float32), input_precision="ieee")
                        part = tl.dot(hi.to(tl.float32), xo.to(tl.float32), part, input_precision="ieee")
                    else:
                        part = tl.dot(lo.to(xe.dtype), xe)
                        part = tl.dot(hi.to(xo.dtype), xo, part)
                    acc += part * sc
            else:
                c = f0 + tl.arange(0, BLOCK_K)
                jb = f0 // 2 + tl.arange(0, BLOCK_K // 2)
                sb = f0 // 32 + tl.arange(0, BLOCK_K // 32)
                if EVEN_K:
                    xm = rm[None, :]
                    wm = lm[:, None]
                    sm = lm[:, None]
                else:
                    xm = (c < F)[:, None] & rm[None, :]
                    wm = lm[:, None] & (jb < FH)[None, :]
                    sm = lm[:, None] & (sb < FS)[None, :]
                x = tl.load(h_ptr + r64[None, :] * F + c[:, None], mask=xm, other=0.0)
                b2 = tl.load(w2p_ptr + wrow * FH + jb[None, :], mask=wm, other=0)
                s2 = tl.load(w2s_ptr + wrow * FS + sb[None, :], mask=sm, other=127)
                if DOT_SCALED:
                    acc = tl.dot_scaled(b2, s2, "e2m1", x, None, FMT, acc)
                else:
                    q = s2.to(tl.int32)
                    if BITS:
                        edge = tl.reduce(tl.reduce(((q < 2) | (q > 252)).to(tl.int32), 1, _MAX), 0, _MAX)
                    else:
                        edge = 1
                    if edge == 0:
                        b = b2.to(tl.int32)
                        cd = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_F, BLOCK_K))
                        m = cd & 7
                        base = tl.reshape(tl.broadcast_to(((q - 1) << 7)[:, :, None], (BLOCK_F, BLOCK_K // 32, 32)),
                                          (BLOCK_F, BLOCK_K))
                        v = tl.where(m == 0, 0, (base + (m << 6) - ((m == 1).to(tl.int32) << 6)) | ((cd & 8) << 12))
                        w2 = v.to(tl.int16).to(tl.bfloat16, bitcast=True).to(x.dtype)
                    else:
                        s = s2.to(tl.int32)
                        sc = tl.where(s == 0, 4194304, s << 23).to(tl.float32, bitcast=True)
                        sc = tl.where(s == 255, float("nan"), sc)
                        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_F, BLOCK_K // 32, 16)),
                                        (BLOCK_F, BLOCK_K // 2))
                        b = b2.to(tl.int32)
                        lo = ((((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
                              .to(tl.float32) * 16384.0 * sc)
                        hi = ((((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
                              .to(tl.float32) * 16384.0 * sc)
                        w2 = tl.reshape(tl.join(lo.to(x.dtype), hi.to(x.dtype)), (BLOCK_F, BLOCK_K))
                    if IEEE:
                        acc = tl.dot(w2.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(w2, x, acc)
        tl.store(y_ptr + r64[None, :] * L + lr[:, None], acc, mask=lm[:, None] & rm[None, :])


@functools.lru_cache(maxsize=4)
def _kernels(interpret: bool, tune: bool):
    """The jitted kernels (one pair per interpreter setting: ``triton.jit`` picks compiled or interpreted when it
    wraps the function). With `tune`, each wrapped in ``triton.autotune`` over its table (_TUNE_GATE_UP, _TUNE_DOWN),
    keyed by the shape, the tile count's log2, BLOCK_T and the decode (DOT_SCALED, BITS); every config writes the
    same outputs from the same inputs, so the timing runs leave nothing behind."""
    import triton

    _triton.bind(globals())
    # EVEN_K: the step along the contracted dimension (L for gate/up, F for down) divides it: no column masks
    gate_up = triton.heuristics({"EVEN_K": lambda a: a["L"] % a["BLOCK_K"] == 0})(triton.jit(_gate_up_kernel))
    down = triton.heuristics({"EVEN_K": lambda a: a["F"] % a["BLOCK_K"] == 0})(triton.jit(_down_kernel))
    if not tune:
        return gate_up, down
    key = ["L", "F", "tiles_log2", "BLOCK_T", "DOT_SCALED", "BITS", "NIBBLES"]
    names = ("BLOCK_F", "BLOCK_K")
    return (_triton.autotuned(gate_up, _TUNE_GATE_UP, names, key),
            _triton.autotuned(down, _TUNE_DOWN, names, key))


def block_tokens(pairs: int, experts: int) -> int:
    """Rows per tile (BLOCK_T): the mean (token, slot) pairs per expert that can be touched, as a power of two in
    [16, 64] (16: a matrix unit's smallest side; 64: two [128, 64] fp32 accumulators still fit the registers)."""
    mean = -(-pairs // max(1, min(experts, pairs)))
    return min(64, max(16, 1 << (mean - 1).bit_length()))


def tile_map(indices: Tensor, num_experts: int, block_t: int) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs sorted by expert and cut into tiles, on the device (no read-back).

    Returns (order [M], pos [M], tiles [T, 3] int32) for the M = N*k (token, slot) pairs: `order` the pair ids
    sorted by expert (stable), `pos` its inverse (the sorted row of each pair), and per tile (expert, first row,
    end of the expert's rows), the expert -1 past the last tile. T = min(E, M) + M // block_t bounds the tiles:
    sum_e ceil(c_e / B) <= #(experts with c_e > 0) + sum_e (c_e - 1) // B."""
    flat = indices.reshape(-1)
    M = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(M, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat.long(), torch.ones(M, dtype=torch.int64, device=dev))
    ends = torch.cumsum(counts, 0)
    per_expert = (counts + block_t - 1) // block_t
    tile_end = torch.cumsum(per_expert, 0)
    T = min(num_experts, M) + M // block_t
    t = torch.arange(T, device=dev)
    expert = torch.searchsorted(tile_end, t, right=True)  # experts whose tiles all end at or before t
    e = expert.clamp(max=num_experts - 1)
    first = ends[e] - counts[e] + (t - (tile_end[e] - per_expert[e])) * block_t
    tiles = torch.stack([torch.where(expert < num_experts, e, -1), first, ends[e]], 1).to(torch.int32)
    return order, pos, tiles


def grouped_experts(z: Tensor, weights: Tensor, indices: Tensor, w, beta1: float, beta2: float,
                    activations: str | None, decode: str = "auto", block_t: int | None = None,
                    autotune: bool | None = None) -> Tensor:
    """The routed experts on the grouped kernels (the caller, k3.ops.mx_moe.mx_moe_packed_grouped, has checked
    the inputs). `decode`: "dot_scaled", "registers", "bits" (bf16 tokens), "nibbles" or "auto" (registers:
    measured faster than dot_scaled at 1, 16 and 64 release-shaped tokens on an H100); `block_t`: rows per tile
    (None: :func:`block_tokens`); `autotune`: None tunes when compiled."""
    if decode not in DECODES:
        raise ValueError(f"decode={decode!r} is invalid: use one of {DECODES}")
    N, L = z.shape
    k = indices.shape[1]
    E, F, _ = w.shape
    dt = z.dtype
    if decode == "auto":
        decode = "registers"
    if decode == "dot_scaled" and dt not in (torch.bfloat16, torch.float16):
        raise ValueError(f"decode='dot_scaled' multiplies bf16 or fp16 tokens, got {dt}: use decode='registers'")
    if decode == "bits" and dt != torch.bfloat16:
        raise ValueError(f"decode='bits' builds bf16 weights for bf16 tokens, got {dt}: use decode='registers'")
    if block_t is None:
        block_t = block_tokens(N * k, E)
    if not isinstance(block_t, int) or block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t!r} must be a power of two >= 16")
    if N == 0:
        return torch.empty(0, L, device=z.device, dtype=dt)
    zq = (mxfp8_fake_quantize_any(z) if activations == "mxfp8" else z).contiguous()
    order, pos, tiles = tile_map(indices, E, block_t)
    M, T = N * k, tiles.shape[0]
    h = torch.empty(M, F, device=z.device, dtype=dt)
    y = torch.empty(M, L, device=z.device, dtype=torch.float32)
    w1p, w1s, w3p, w3s, w2p, w2s = (t.contiguous() for t in w)
    interpret = _triton.interpret()
    tune = not interpret if autotune is None else autotune
    gate_up, down = _kernels(interpret, tune)
    # IEEE: the registers decode dots in fp32 (IEEE, not TF32) for fp32 tokens, and for every dtype in Triton's
    # interpreter, whose tl.dot on bf16 operands is wrong (triton 3.9); bf16 products are exact in fp32, so only the
    # order of the fp32 sums differs from the compiled bf16 dot
    flags = dict(BLOCK_T=block_t, DOT_SCALED=decode == "dot_scaled", FMT="fp16" if dt == torch.float16 else "bf16",
                 IEEE=dt == torch.float32 or interpret, BITS=decode == "bits", NIBBLES=decode == "nibbles")
    tiles_log2 = (T - 1).bit_length()
    if tune:
        fixed = {}
    else:
        bf, bk, warps, stages = _INTERPRET_CONFIG if interpret else _FIXED_CONFIG
        fixed = dict(BLOCK_F=bf, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    with torch.cuda.device(z.device.index if z.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        gate_up[lambda meta: (T, -(-F // meta["BLOCK_F"]))](
            zq, order, tiles, w1p, w1s, w3p, w3s, h, L, L // 2, L // 32, F, float(beta1), float(beta2), tiles_log2,
            K=k, **flags, **fixed)
        if activations == "mxfp8":
            h = mxfp8_fake_quantize_any(h).contiguous()
        down[lambda meta: (T, -(-L // meta["BLOCK_F"]))](h, tiles, w2p, w2s, y, L, F, F // 2, F // 32, tiles_log2,
                                                         **flags, **fixed)
    return moe_combine(y, pos, weights, dt)
