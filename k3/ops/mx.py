"""MXFP4 / MXFP8 microscaling formats (OCP MX) for K3's low-precision paths (report §2.7).

The routed expert weights of the official checkpoint are MXFP4: a dense W [out, in]
is stored as

* ``weight_packed`` uint8 [out, in/2]: two E2M1 codes per byte; byte j of a row holds
  column 2j in the low nibble and column 2j+1 in the high nibble;
* ``weight_scale``  uint8 [out, in/32]: one E8M0 scale per 32 consecutive columns.

An E2M1 code has a sign bit (bit 3) and a 3-bit magnitude index (bits 0-2) into
(0, 0.5, 1, 1.5, 2, 3, 4, 6); an E8M0 byte s is the power of two 2^(s - 127) (255 is NaN).
Every function also accepts leading batch dims (e.g. stacked experts [E, out, in/2]).

MXFP8 (E4M3 values, same E8M0 block scales) is used for activations in QAT.

Quantization-aware training (report §4.1.4) calls the fake quantizers through the op registry
(``mxfp4_fake_quantize_any``, ``mxfp8_fake_quantize_any``; ops ``mxfp4_fake_quant`` and
``mxfp8_fake_quant``): the PyTorch reference here is the definition, and the fused Triton kernel of
k3.ops.mx_triton (one pass: block max, scale, round, rescale) registers beside it as the ``triton``
implementation of each op, tested bit-exact against it (in Triton's interpreter on CPU, compiled on an H200,
where ``auto`` takes it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.mx_triton import mxfp4_fake_quantize_triton, mxfp8_fake_quantize_triton
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = [
    "E2M1_VALUES",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "mxfp4_fake_quantize",
    "mxfp8_fake_quantize",
    "mxfp4_fake_quantize_any",
    "mxfp8_fake_quantize_any",
]

MX_BLOCK = 32
# Code -> value for the 16 E2M1 codes. Code 8 (-0) decodes to +0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_EMAX = 2  # largest E2M1 exponent: 6 = 1.5 * 2^2
_E4M3_EMAX = 8  # largest E4M3 exponent: 448 = 1.75 * 2^8
_E4M3_MAX = 448.0
_E8M0_MIN, _E8M0_MAX = -127, 127  # exponents of the 255 finite E8M0 scales


def _check_weight(name: str, w: Tensor, block: int) -> None:
    if not isinstance(w, Tensor) or not w.dtype.is_floating_point:
        got = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"{name} must be a floating tensor, got {got}")
    if w.ndim < 1 or w.shape[-1] % block != 0:
        raise ValueError(f"{name} last dim must be a multiple of the block size {block}, got shape {tuple(w.shape)}")


def _block_exponent(amax: Tensor, emax: int) -> Tensor:
    """Shared E8M0 exponent of each block: floor(log2(amax)) - emax, clamped (OCP MX)."""
    # frexp is exact (amax = mantissa * 2^e with mantissa in [0.5, 1)), unlike log2.
    _, e = torch.frexp(amax)
    exp = (e - 1 - emax).float()
    exp = torch.where(amax > 0, exp, torch.full_like(exp, _E8M0_MIN))  # all-zero block: any scale works
    return exp.clamp(_E8M0_MIN, _E8M0_MAX)


def mxfp4_dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Decode MXFP4 storage to a dense tensor.

    Args:
        packed: uint8 [..., in/2] E2M1 code pairs (low nibble = even column).
        scale: uint8 [..., in/32] E8M0 block scales.
        dtype: output dtype. Exact for bf16 and wider (3-bit significands), barring
            over/underflow of extreme scales.

    Returns:
        [..., in] values ``E2M1[code] * 2^(scale - 127)``.
    """
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    if not isinstance(scale, Tensor) or scale.dtype != torch.uint8:
        raise ValueError(f"scale must be a uint8 tensor, got {getattr(scale, 'dtype', type(scale).__name__)}")
    if packed.ndim < 1 or packed.shape[-1] % (MX_BLOCK // 2) != 0:
        raise ValueError(
            f"packed must be [..., in/2] with in a multiple of {MX_BLOCK}, got shape {tuple(packed.shape)}"
        )
    n_blocks = packed.shape[-1] * 2 // MX_BLOCK
    if scale.shape != (*packed.shape[:-1], n_blocks):
        raise ValueError(
            f"scale must have shape {(*packed.shape[:-1], n_blocks)} (one per {MX_BLOCK} columns of packed), "
            f"got {tuple(scale.shape)}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")

    # Unpack: column 2j is the low nibble of byte j, column 2j+1 the high nibble.
    low = packed & 0x0F
    high = packed >> 4
    codes = torch.stack([low, high], dim=-1).flatten(-2).long()  # [..., in]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[codes]

    # E8M0: 2^(s - 127), exact in fp32 (2^-127 is a subnormal); 255 encodes NaN.
    s = scale.float()
    block_scale = torch.where(scale == 255, torch.full_like(s, float("nan")), torch.exp2(s - 127))
    values = values.unflatten(-1, (n_blocks, MX_BLOCK)) * block_scale[..., None]
    return values.flatten(-2).to(dtype)


def mxfp4_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """Encode a dense tensor to MXFP4 storage (round to nearest, ties to even code, saturating).

    Args:
        w: [..., in] floating, finite, ``in % 32 == 0``.

    Returns:
        (packed uint8 [..., in/2], scale uint8 [..., in/32]).
    """
    _check_weight("w", w, MX_BLOCK)
    blocks = w.detach().float().unflatten(-1, (w.shape[-1] // MX_BLOCK, MX_BLOCK))  # [..., nb, 32]

    # Shared exponent: the block max lands in [4, 8) after scaling, E2M1's top binade.
    exp = _block_exponent(blocks.abs().amax(dim=-1), _E2M1_EMAX)  # [..., nb]
    a = (blocks * torch.exp2(-exp)[..., None]).abs()

    # Nearest of (0, .5, 1, 1.5, 2, 3, 4, 6): count the midpoints passed. At a tie the
    # even code wins: '>' when the lower code is even, '>=' when it is odd. Above 5 -> 6.
    mag = (
        (a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
        + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int()
    )
    # Sign bit only for non-zero magnitudes: zeros are always encoded as +0.
    codes = torch.where((blocks < 0) & (mag > 0), mag + 8, mag).to(torch.uint8).flatten(-2)

    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = (exp + 127).to(torch.uint8)
    return packed, scale


def mxfp4_fake_quantize(w: Tensor) -> Tensor:
    """``dequantize(quantize(w))`` in ``w.dtype``, with a straight-through (identity) gradient."""
    _check_weight("w", w, MX_BLOCK)
    q = mxfp4_dequantize(*mxfp4_quantize(w), dtype=w.dtype)
    # Forward value is exactly q; the gradient flows to w unchanged.
    return q + (w - w.detach())


def mxfp8_fake_quantize(x: Tensor, block: int = MX_BLOCK) -> Tensor:
    """MXFP8 (E4M3 values, E8M0 scale per ``block`` along the last dim) fake quantization.

    Args:
        x: [..., D] floating, ``D % block == 0``.
        block: elements sharing one scale (OCP MX: 32).

    Returns:
        Quantized-dequantized x in ``x.dtype`` (round to nearest even, saturating at
        ±448 * scale), with a straight-through (identity) gradient.
    """
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    _check_weight("x", x, block)
    blocks = x.detach().float().unflatten(-1, (x.shape[-1] // block, block))

    exp = _block_exponent(blocks.abs().amax(dim=-1), _E4M3_EMAX)[..., None]
    scaled = (blocks * torch.exp2(-exp)).clamp(-_E4M3_MAX, _E4M3_MAX)  # saturate explicitly (OCP MX), not via the cast
    q = scaled.to(torch.float8_e4m3fn).float() * torch.exp2(exp)
    return q.flatten(-2).to(x.dtype) + (x - x.detach())


register(Op("mxfp4_fake_quant", reference=mxfp4_fake_quantize,
            fast=(Fast("triton", mxfp4_fake_quantize_triton, _triton.available, validated=True, cpu=True),),
            tolerance="bit-exact: a fused kernel must give dequantize(quantize(w)) to the bit (the values are exact "
                      "in fp32 and bf16; nothing is summed)"))
register(Op("mxfp8_fake_quant", reference=mxfp8_fake_quantize,
            fast=(Fast("triton", mxfp8_fake_quantize_triton, _triton.available, validated=True, cpu=True),),
            tolerance="bit-exact: the same E8M0 scale and round-to-nearest-even E4M3 cast as the reference"))


def mxfp4_fake_quantize_any(w: Tensor, backends: Backends | None = None) -> Tensor:
    """``mxfp4_fake_quantize`` on the implementation the registry picks (op ``mxfp4_fake_quant``)."""
    return dispatch("mxfp4_fake_quant", w, backends).fn(w)


def mxfp8_fake_quantize_any(x: Tensor, backends: Backends | None = None) -> Tensor:
    """``mxfp8_fake_quantize`` (32 per scale) on the implementation the registry picks (op ``mxfp8_fake_quant``)."""
    return dispatch("mxfp8_fake_quant", x, backends).fn(x)
