"""The fused MXFP4 / MXFP8 fake-quantization kernels (k3.ops.mx_triton) against k3.ops.mx's reference: bit for bit.

Every step of both roundings is exact arithmetic (exponent bits, powers of two built from bits, midpoint counts,
round-to-nearest-even by the fp32 magic number), so the tolerance is zero: outputs are compared as integers.
CPU tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the GPU test (marked `gpu`)
runs it compiled. Inputs cover what the encoders must get right: E2M1 rounding midpoints (ties to the even code),
E4M3 ties and saturation at 448 x scale, all-zero blocks, negative zeros, values spanning 2^-40 .. 2^40 per block
(E8M0 exponents at both ends), subnormal fp32 inputs and bf16 (whose blocks below 2^-126 are not compared in the
interpreter, whose bf16 conversions differ there).
"""

import pytest
import torch

from k3.ops.mx import mxfp4_fake_quantize, mxfp4_fake_quantize_any, mxfp8_fake_quantize
from k3.ops.mx_triton import mxfp4_fake_quantize_triton, mxfp8_fake_quantize_triton
from k3.ops.registry import Backends

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PAIRS = [(mxfp4_fake_quantize, mxfp4_fake_quantize_triton), (mxfp8_fake_quantize, mxfp8_fake_quantize_triton)]


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _hard_values(shape=(5, 12, 96), seed=0, device="cpu", subnormal=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape[:-1] + (1,), generator=g).float())
    if len(shape) != 3:
        return x.to(device)
    x[0, :, :4] = torch.tensor([0.25, 0.75, 2.5, 5.0])  # E2M1 midpoints against a block max of 6
    x[0, :, 4] = 6.0
    x[1, 0, :8] = torch.tensor([1.0625, 1.1875, -1.0625, 448.0, 464.0, 480.0, -500.0, 1.0])  # E4M3 ties, saturation
    x[1, 1] = 0.0  # all-zero blocks
    x[1, 2, 3] = -0.0
    if subnormal:
        x[2, 0] *= 1e-38  # subnormal fp32 inputs
        x[2, 1, :32] = torch.linspace(-1, 1, 32) * 2.0 ** -130
    return x.to(device)


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ref,fast", PAIRS, ids=["mxfp4", "mxfp8"])
def test_fused_fake_quant_is_the_reference_bit_for_bit(interpret, ref, fast, dtype):
    for seed in range(3):
        # bf16 blocks below 2^-126 are left out: there the interpreter's bf16 conversions differ from the compiled
        # kernel's and the reference's (no weight or activation of a trained model lives there)
        x = _hard_values(seed=seed, subnormal=dtype == torch.float32).to(dtype)
        got, want = fast(x), ref(x)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("ref,fast", PAIRS, ids=["mxfp4", "mxfp8"])
def test_gradient_passes_straight_through(interpret, ref, fast):
    x = _hard_values(shape=(3, 64)).requires_grad_()
    g = torch.randn(3, 64)
    fast(x).backward(g)
    assert torch.equal(x.grad, g)


def test_non_contiguous_inputs_and_bad_shapes(interpret):
    x = _hard_values(shape=(64, 96))[:, :64]  # rows of 64 out of 96: not contiguous
    assert torch.equal(_bits(mxfp8_fake_quantize_triton(x)), _bits(mxfp8_fake_quantize(x)))
    with pytest.raises(ValueError, match="multiple of the block size"):
        mxfp4_fake_quantize_triton(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="floating"):
        mxfp4_fake_quantize_triton(torch.zeros(4, 32, dtype=torch.int32))


def test_the_op_dispatches_to_the_kernel_when_asked(interpret):
    x = _hard_values(shape=(4, 64))
    got = mxfp4_fake_quantize_any(x, Backends(per_op={"mxfp4_fake_quant": "triton"}))
    assert torch.equal(_bits(got), _bits(mxfp4_fake_quantize(x)))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ref,fast", PAIRS, ids=["mxfp4", "mxfp8"])
def test_gpu_fused_fake_quant_is_the_reference_bit_for_bit(ref, fast, dtype):
    for seed in range(3):
        # no blocks below 2^-119 here: there MXFP8's exponent clamps at E8M0's smallest scale 2^-127, which the
        # reference gets from torch.exp2, inexact on CUDA for that subnormal result (the kernel builds it from bits)
        x = _hard_values(shape=(64, 128, 512), seed=seed, device="cuda", subnormal=False).to(dtype)
        assert torch.equal(_bits(fast(x)), _bits(ref(x)))
