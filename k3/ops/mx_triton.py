"""Fused MXFP4 / MXFP8 fake quantization for quantization-aware training (report §4.1.4): one Triton pass per tensor.

k3.ops.mx defines both roundings in PyTorch (block max, shared E8M0 exponent, scale, round, rescale: about ten
passes over the tensor, several in fp32). Here one program takes BLOCK_B blocks of 32 consecutive elements of the
last dimension (the tensor is contiguous, so the blocks are the rows of a [n/32, 32] view), reads them once and
writes the fake-quantized values once, in the input's dtype. The backward is the straight-through identity, as in
the reference. Every step is exact arithmetic, so the result equals the reference bit for bit (finite inputs;
Triton's interpreter converts bf16 blocks below 2^-126 differently, and on CUDA the reference's torch.exp2 is
inexact for E8M0's smallest scale 2^-127, which MXFP8 blocks below 2^-119 use: the tests leave those out):

* the block exponent floor(log2(amax)) is read from amax's fp32 exponent bits (amax is a value of the block,
  exact in fp32), minus the format's largest exponent (2 for E2M1, 8 for E4M3), clamped to E8M0's [-127, 127]
  (an all-zero block gets -127: any scale gives zeros);
* powers of two are built from their bits (2^k for k in [-126, 127] as a biased exponent, 2^-127 as the
  subnormal 2^22 ulp), never by exp2, whose GPU form is approximate;
* E2M1: the magnitude is the count of rounding midpoints passed (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; ties to
  the even code: strict at an even lower code, inclusive at an odd one), exactly the reference's rule;
* E4M3: values are clamped to +-448 (saturation, as OCP MX), then rounded to nearest even at the quantum of their
  binade (2^(e - 3) for normal values, 2^-9 below 2^-6) with the fp32 magic-number trick: for 0 <= n < 2^23,
  (n + 2^23) - 2^23 is n rounded to nearest even under fp32 arithmetic.

Validated on an H200 (bit for bit against the reference; QAT of k3-mini then costs no measurable step time, where
the reference costs 39%: BENCHMARKS.md), so ``auto`` takes it on CUDA. ``TRITON_INTERPRET=1`` runs the kernels on
CPU tensors (tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton

__all__ = ["mxfp4_fake_quantize_triton", "mxfp8_fake_quantize_triton"]

BLOCK = 32
# triton.language and the max combine function, bound on first use (k3.ops._triton.bind)
tl = None
_MAX = None


def _fake_quant_kernel(x_ptr, y_ptr, n_blocks, BLOCK_B: tl.constexpr, FP8: tl.constexpr):
    """Program b: blocks b*BLOCK_B .. of 32 elements each, fake-quantized to MXFP4 (FP8=False) or MXFP8."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    rm = rows < n_blocks
    offs = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + offs, mask=rm[:, None], other=0.0).to(tl.float32)
    ax = tl.abs(x)
    amax = tl.reduce(ax, 1, _MAX)  # [BLOCK_B]
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 255  # floor(log2 amax) + 127 for a normal amax
    if FP8:
        emax = 8
    else:
        emax = 2
    exp = tl.where(amax > 0, biased - 127 - emax, -127)
    exp = tl.where(biased == 0, -127, exp)  # zero or subnormal amax: below E8M0's range after -emax
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    # 2^-exp and 2^exp from their bits (exp in [-127, 127]: 2^-exp may be 2^127; 2^exp may be the subnormal 2^-127)
    inv = tl.where(exp > -127, ((127 - exp) << 23).to(tl.float32, bitcast=True), 1.7014118346046923e38)
    scale = tl.where(exp > -127, ((exp + 127) << 23).to(tl.float32, bitcast=True),
                     (tl.full(exp.shape, 1 << 22, tl.int32)).to(tl.float32, bitcast=True))
    a = ax * inv[:, None]
    if FP8:
        a = tl.minimum(a, 448.0)
        ab = (a.to(tl.int32, bitcast=True) >> 23) & 255  # the binade of a (0: zero or subnormal)
        e = tl.maximum(ab - 127, -6)  # E4M3's smallest normal exponent is -6; below it the quantum is 2^-9
        qinv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # 2^-(e - 3)
        qnt = ((127 + (e - 3)) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
        n = a * qinv  # < 16: the significand in units of the quantum
        r = (n + 8388608.0) - 8388608.0  # round to nearest even (fp32 arithmetic)
        mag = r * qnt
    else:
        m = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
             + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
             + (a > 5.0).to(tl.int32))
        mf = m.to(tl.float32)
        mag = tl.where(m < 4, mf * 0.5, tl.where(m < 6, mf - 2.0, mf * 2.0 - 8.0))  # E2M1: 0 .5 1 1.5 2 3 4 6
    q = tl.where(x < 0, -mag, mag) * scale[:, None]
    q = tl.where(mag == 0, 0.0, q)  # zeros are +0, as the reference encodes them
    tl.store(y_ptr + offs, q.to(y_ptr.dtype.element_ty), mask=rm[:, None])


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_fake_quant_kernel)


def _launch(x: Tensor, fp8: bool) -> Tensor:
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MX fake-quantization kernel cannot run: {why}")
    src = x.detach().contiguous()
    y = torch.empty_like(src)
    n_blocks = src.numel() // BLOCK
    if n_blocks:
        block_b = 64
        with torch.cuda.device(src.device.index if src.is_cuda else -1):  # the tensors' GPU; -1: no-op
            _kernel(_triton.interpret())[(-(-n_blocks // block_b),)](src, y, n_blocks, BLOCK_B=block_b, FP8=fp8,
                                                                      num_warps=4)
    return y.view(x.shape)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, fp8: bool) -> Tensor:
        return _launch(x, fp8)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


def _check(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name} last dim must be a multiple of the block size {BLOCK}, got shape {tuple(x.shape)}")


def mxfp4_fake_quantize_triton(w: Tensor) -> Tensor:
    """k3.ops.mx.mxfp4_fake_quantize in one fused pass (bit-exact), straight-through gradient."""
    _check("w", w)
    return _StraightThrough.apply(w, False)


def mxfp8_fake_quantize_triton(x: Tensor) -> Tensor:
    """k3.ops.mx.mxfp8_fake_quantize (32 per scale) in one fused pass (bit-exact), straight-through gradient."""
    _check("x", x)
    return _StraightThrough.apply(x, True)
