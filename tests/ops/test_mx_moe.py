"""The routed experts computed from MXFP4 storage (k3.ops.mx_moe) against the dequantize-then-compute reference.

The reference decodes each touched expert and runs k3.ops.moe.moe_experts' loop: it is compared with moe_experts on
the decoded weights bit for bit (the same GEMMs on the same values). The token-centric Triton kernels run in
Triton's interpreter on CPU (TRITON_INTERPRET=1, set in-process) and compiled on a GPU (tests marked by
`needs_cuda`); tolerances are the op's registered ones: fp32 1e-5 of the largest output entry (fp32 accumulation
in another order, tanh from exponentials), bf16 2e-2 relative (the reference rounds each GEMM's output to bf16).
"""

import pytest
import torch

from k3.ops.moe import moe_experts
from k3.ops.mx import mxfp4_dequantize, mxfp4_quantize, mxfp8_fake_quantize
from k3.ops.mx_moe import PackedExpertWeights, mx_moe_packed, mx_moe_packed_any, mx_moe_packed_triton
from k3.ops.registry import Backends, dispatch
from k3.ops.situ import situ_glu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
B1, B2 = 4.0, 25.0


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(E=6, F=64, L=96, N=5, k=2, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(shape, generator=g) * 0.1 for shape in ((E, F, L), (E, F, L), (E, L, F))]
    packed = PackedExpertWeights(*(t.to(device) for wi in w for t in mxfp4_quantize(wi)))
    z = torch.randn(N, L, generator=g).to(device)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(device)
    weights = torch.rand(N, k, generator=g).to(device)
    return z, weights, indices, packed


def _decoded(packed, dtype):
    return [mxfp4_dequantize(packed[i], packed[i + 1], dtype) for i in (0, 2, 4)]


@pytest.mark.parametrize("activations", [None, "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_dense_experts_on_the_decoded_weights_bit_for_bit(activations, dtype):
    z, weights, indices, packed = _case()
    z = z.to(dtype)
    a = mxfp8_fake_quantize if activations else (lambda x: x)
    want = moe_experts(a(z), weights, indices, *_decoded(packed, dtype),
                       lambda g, u: a(situ_glu(g, u, B1, B2).to(dtype)))
    got = mx_moe_packed(z, weights, indices, packed, B1, B2, activations)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("activations", [None, "mxfp8"])
@pytest.mark.parametrize("shape", [dict(), dict(E=4, F=32, L=160, N=3, k=3), dict(N=1, k=1)])
def test_triton_kernels_equal_the_reference_fp32(interpret, activations, shape):
    z, weights, indices, packed = _case(**shape, seed=1)
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, activations)
    got = mx_moe_packed_triton(z, weights, indices, packed, B1, B2, activations)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_triton_kernels_bf16(interpret):
    # without the MXFP8 rounding: an MXFP8 step is 1/16 of a value, so where two implementations round a GEMM
    # output differently (bf16 vs fp32 here) a value near a rounding boundary moves by a whole step; the kernels'
    # MXFP8 path is checked in fp32 above, where both sides round the same values
    z, weights, indices, packed = _case(seed=2)
    z = z.to(torch.bfloat16)
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, None)
    got = mx_moe_packed_triton(z, weights, indices, packed, B1, B2, None)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_auto_runs_the_reference_on_cpu():
    z, weights, indices, packed = _case(seed=3)
    ref = mx_moe_packed(z, weights, indices, packed, B1, B2, "mxfp8")
    assert torch.equal(mx_moe_packed_any(z, weights, indices, packed, B1, B2, "mxfp8"), ref)
    assert dispatch("mx_moe", z, Backends()).name == "torch"


def test_bad_inputs_name_what_is_wrong():
    z, weights, indices, packed = _case()
    with pytest.raises(ValueError, match="latent width"):
        mx_moe_packed(z[:, :64], weights, indices, packed, B1, B2)
    with pytest.raises(ValueError, match="w2_scale"):
        mx_moe_packed(z, weights, indices, PackedExpertWeights(*packed[:5], packed[5][:, :, :1]), B1, B2)
    with pytest.raises(ValueError, match="activations"):
        mx_moe_packed(z, weights, indices, packed, B1, B2, "mxfp6")
    with pytest.raises(ValueError, match="uint8"):
        mx_moe_packed(z, weights, indices, PackedExpertWeights(*packed[:5], packed[5].float()), B1, B2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 16, 64])
def test_triton_kernels_on_gpu(N):
    z, weights, indices, packed = _case(E=16, F=256, L=512, N=N, k=4, seed=4, device="cuda")
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, "mxfp8")
    got = mx_moe_packed_triton(z, weights, indices, packed, B1, B2, "mxfp8")
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    zb = z.to(torch.bfloat16)
    got = mx_moe_packed_triton(zb, weights, indices, packed, B1, B2, None).float()
    ref = mx_moe_packed(zb, weights, indices, packed, B1, B2, None).float()
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
