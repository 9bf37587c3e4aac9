"""MXFP4 / MXFP8 microscaling (checkpoint layout, report §2.7)."""

import pytest
import torch

from k3.ops.mx import E2M1_VALUES, mxfp4_dequantize, mxfp4_fake_quantize, mxfp4_quantize, mxfp8_fake_quantize

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack(codes):
    """uint8 codes [..., in] -> bytes [..., in/2], even column in the low nibble (built independently)."""
    codes = codes.to(torch.uint8)
    return codes[..., ::2] + codes[..., 1::2] * 16


def test_dequantize_hand_built_bytes():
    packed = torch.zeros(2, 32, dtype=torch.uint8)  # 2 rows of 64 columns
    packed[0, :4] = torch.tensor([0x21, 0x8F, 0x70, 0x9A], dtype=torch.uint8)
    packed[0, 16] = 0x3C  # first byte of block 1: low C (-2), high 3 (1.5)
    packed[1, 0] = 0xE5  # low 5 (3), high E (-4)
    scale = torch.tensor([[127, 129], [125, 0]], dtype=torch.uint8)  # x1, x4 | x0.25, x2^-127
    w = mxfp4_dequantize(packed, scale, dtype=torch.float32)
    assert w.shape == (2, 64) and w.dtype == torch.float32

    want = torch.zeros(2, 64)
    want[0, :8] = torch.tensor([0.5, 1.0, -6.0, 0.0, 0.0, 6.0, -1.0, -0.5])
    want[0, 32:34] = torch.tensor([-2.0, 1.5]) * 4
    want[1, :2] = torch.tensor([3.0, -4.0]) * 0.25
    assert torch.equal(w, want)
    assert not torch.signbit(w[0, 3])  # code 8 (-0) decodes to +0
    # bf16 (default) is exact: the same numbers.
    w_bf16 = mxfp4_dequantize(packed, scale)
    assert w_bf16.dtype == torch.bfloat16 and torch.equal(w_bf16.float(), want)
    # Extreme scales: 2^-127 and 2^127 are exact in fp32; 255 is NaN.
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x02  # 1.0 in column 0
    assert mxfp4_dequantize(one, torch.tensor([[0]], dtype=torch.uint8), torch.float32)[0, 0] == 2.0**-127
    assert mxfp4_dequantize(one, torch.tensor([[254]], dtype=torch.uint8), torch.float32)[0, 0] == 2.0**127
    assert torch.isnan(mxfp4_dequantize(one, torch.tensor([[255]], dtype=torch.uint8), torch.float32)).all()


def test_dequantize_table_and_leading_dims():
    codes = torch.arange(16).repeat(2)[None, None].expand(3, 2, 32)  # [E, out, in]
    w = mxfp4_dequantize(pack(codes), torch.full((3, 2, 1), 127, dtype=torch.uint8), torch.float32)
    assert w.shape == (3, 2, 32)
    assert torch.equal(w[0, 0, :16], torch.tensor(E2M1_VALUES))
    assert torch.equal(w[..., 8:16], -w[..., :8] + 0.0)


def random_codes_and_scales(gen, out, cols, canonical):
    codes = torch.randint(0, 16, (out, cols), generator=gen)
    if canonical:
        codes = torch.where(codes == 8, 0, codes)  # no -0
        blocks = codes.view(out, cols // 32, 32)
        pos = torch.randint(0, 32, (out, cols // 32, 1), generator=gen)
        top = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (out, cols // 32, 1), generator=gen)]
        blocks.scatter_(2, pos, top)  # every block reaches magnitude 4 or 6
    scale = torch.randint(100, 155, (out, cols // 32), generator=gen, dtype=torch.uint8)
    return pack(codes), scale


def test_quantize_round_trips_canonical_bytes_exactly():
    g = torch.Generator().manual_seed(0)
    packed, scale = random_codes_and_scales(g, 8, 256, canonical=True)
    p2, s2 = mxfp4_quantize(mxfp4_dequantize(packed, scale, torch.float32))
    assert p2.dtype == torch.uint8 and s2.dtype == torch.uint8
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # bf16 input works the same (dequantized values are exact in bf16).
    p3, s3 = mxfp4_quantize(mxfp4_dequantize(packed, scale))
    assert torch.equal(p3, packed) and torch.equal(s3, scale)


def test_quantize_round_trips_values_for_any_codes():
    # With -0 codes, or blocks whose largest magnitude is below 4, the bytes are not unique
    # (the quantizer picks +0 / a smaller exponent), but the decoded values round-trip exactly.
    g = torch.Generator().manual_seed(1)
    packed, scale = random_codes_and_scales(g, 8, 256, canonical=False)
    packed[0, :16] = 0x11  # a whole block of 0.5s: max magnitude 0.5
    packed[1, :16] = 0x88  # a whole block of -0
    w = mxfp4_dequantize(packed, scale, torch.float32)
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(w), dtype=torch.float32), w)


def test_round_to_nearest_ties_to_even_and_saturation():
    # Block max 6 -> exponent 0, so these are the E2M1 grid's own coordinates.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.25, -0.75, -5.0, 0.3, 6.0, 0.0, -1e-3, 2.6])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -1.0, -4.0, 0.5, 6.0, 0.0, 0.0, 3.0])
    w = torch.cat([x, torch.zeros(16)])[None]
    packed, scale = mxfp4_quantize(w)
    assert scale.item() == 127  # floor(log2(7.9)) - 2 = 0
    assert torch.equal(mxfp4_dequantize(packed, scale, torch.float32)[0, :16], want)
    assert packed[0, 4].item() & 0x0F == 0  # -0.25 rounds to +0, not -0
    # Scaled copies quantize to scaled results (only the shared exponent changes).
    p2, s2 = mxfp4_quantize(w * 2.0**-10)
    assert torch.equal(p2, packed) and s2.item() == 117


def test_quantization_error_is_half_a_step():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=g) * 0.02
    w[0, :32] = 0.0  # an all-zero block
    packed, scale = mxfp4_quantize(w)
    assert packed.shape == (64, 256) and scale.shape == (64, 16)
    dq = mxfp4_dequantize(packed, scale, torch.float32)
    assert torch.equal(dq[0, :32], torch.zeros(32))

    unit = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)  # the block scale per element
    a, err = (w / unit).abs(), ((dq - w) / unit).abs()
    block_max = a.view(64, 16, 32).amax(-1)
    nonzero = block_max > 0
    assert ((block_max[nonzero] >= 4) & (block_max[nonzero] < 8)).all()  # E2M1's top binade
    # Grid spacing: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; beyond 6 it saturates.
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    in_range = a <= 6
    assert (err[in_range] <= half_step[in_range]).all()
    assert torch.equal(dq.abs()[~in_range], 6 * unit[~in_range])
    assert (err[~in_range] < 2).all()
    assert (torch.sign(dq) * torch.sign(w) >= 0).all()


def test_fake_quantize_forward_and_identity_gradient():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(8, 64, generator=g) * 0.1).to(dtype).requires_grad_()
        out = mxfp4_fake_quantize(w)
        assert out.dtype == dtype
        assert torch.equal(out.detach(), mxfp4_dequantize(*mxfp4_quantize(w.detach()), dtype=dtype))
        upstream = torch.randn(8, 64, generator=g).to(dtype)
        out.backward(upstream)
        assert torch.equal(w.grad, upstream)

        x = (torch.randn(4, 3, 96, generator=g) * 5).to(dtype).requires_grad_()
        y = mxfp8_fake_quantize(x)
        assert y.dtype == dtype and y.shape == x.shape
        upstream = torch.randn(4, 3, 96, generator=g).to(dtype)
        y.backward(upstream)
        assert torch.equal(x.grad, upstream)


def test_mxfp8_values():
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([1.0, 1.0 / 3.0, -0.0625, 1e-4])  # amax 1 -> block scale 2^-8
    x[1, :3] = torch.tensor([1.9, -1.0, 3e-3])  # 1.9 * 256 = 486.4 > 448: saturates
    y = mxfp8_fake_quantize(x)
    # 1/3 * 256 = 85.33 -> 88 on the E4M3 grid (step 8 in [64, 128));
    # 1e-4 * 256 = 0.0256 -> 13 * 2^-9 (step 2^-9 in [2^-6, 2^-5)).
    assert torch.equal(y[0, :4], torch.tensor([1.0, 88 / 256, -0.0625, 13 * 2.0**-9 / 256]))
    assert torch.equal(y[1, :3], torch.tensor([448 / 256, -1.0, 0.0029296875]))
    assert torch.equal(y[:, 4:], torch.zeros(2, 28))

    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 128, generator=g) * 3
    y = mxfp8_fake_quantize(x)
    amax = x.abs().view(16, 4, 32).amax(-1)
    unit = torch.exp2(torch.floor(torch.log2(amax)) - 8).repeat_interleave(32, -1)
    scaled = y / unit
    assert torch.equal(scaled.to(torch.float8_e4m3fn).float(), scaled)  # on the E4M3 grid
    assert (scaled.abs() <= 448).all()
    normal = (x / unit).abs() <= 448
    # Half an ulp of a 3-bit mantissa (2^-4 relative), or half the smallest subnormal step.
    bound = torch.maximum(x.abs() * 2.0**-4, unit * 2.0**-10)
    assert ((y - x).abs()[normal] <= bound[normal]).all()
    # Custom block size.
    assert mxfp8_fake_quantize(torch.ones(2, 12), block=4).shape == (2, 12)


def test_validation():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp4_quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="w must be a floating tensor"):
        mxfp4_quantize(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed must be a uint8"):
        mxfp4_dequantize(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale must be a uint8"):
        mxfp4_dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="packed must be"):
        mxfp4_dequantize(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale must have shape"):
        mxfp4_dequantize(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp8_fake_quantize(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        mxfp8_fake_quantize(torch.zeros(4, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp4_fake_quantize(torch.zeros(4, 33))
