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


def test_triton_kernels_pairs_and_edge_scales(interpret):
    # pairs=True: the per-pair outputs (token order) whose combine is the output; scales at the ends of E8M0
    # (0: 2^-127; 253 and 254: weights near fp32's top, code 7 at 254 is +inf) decode as the reference decodes
    z, weights, indices, packed = _case(F=32, L=64, N=3, k=2, seed=5)
    y = mx_moe_packed_triton(z, weights, indices, packed, B1, B2, None, pairs=True)
    assert y.shape == (6, 64) and y.dtype == z.dtype
    u = (y.view(3, 2, 64) * weights[:, :, None]).sum(1)
    assert torch.allclose(u, mx_moe_packed_triton(z, weights, indices, packed, B1, B2, None), rtol=1e-6, atol=1e-7)
    w1p, w1s, w3p, w3s, w2p, w2s = (t.clone() for t in packed)
    e = int(indices[0, 0])
    w1p[e, 0, :16] = 0
    w1s[e, 0, 0], w1p[e, 0, 0] = 253, 0x05  # column 0: code 5 (3.0) times 2^126, finite
    w1s[e, 1, 0] = 0
    w3s[e, 2, 1] = 240
    w3p[e, 2, 16:32] = 0x11  # columns 32..63 of row 2: 0.5 * 2^113 each
    w2s[e, 0, 0] = 0
    edge = PackedExpertWeights(w1p, w1s, w3p, w3s, w2p, w2s)
    z2 = z.clone()
    z2[:, 0] = 1e-37  # w1 row 0 at 3 * 2^126 times a tiny input: a finite gate
    z2[:, 32:] *= 1e-33
    want = mx_moe_packed(z2, weights, indices, edge, B1, B2, None)
    got = mx_moe_packed_triton(z2, weights, indices, edge, B1, B2, None)
    assert bool(torch.isfinite(want).all())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


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
