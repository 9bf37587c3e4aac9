"""The MoE combine kernel (k3.ops.moe_combine) against its PyTorch reference.

CPU tests run the Triton kernel in Triton's interpreter (TRITON_INTERPRET=1, set in-process); GPU tests (marked
`gpu`) run the compiled kernel. Tolerances: fp32 outputs and gradients 1e-5 relative to the largest reference
entry (only the order of the k-term sums differs); bf16 outputs one bf16 ulp (2^-7 relative; the interpreter
truncates on conversion where the compiled kernel rounds), d(weights) is accumulated in fp32 either way.
"""

import pytest
import torch
from helpers import rel_err

from k3.ops.moe_combine import moe_combine, moe_combine_torch, moe_combine_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(N, k, L, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(N * k, L, generator=g).to(device=device, dtype=dtype)
    pos = torch.randperm(N * k, generator=g).to(device)
    w = torch.rand(N, k, generator=g).to(device)
    du = torch.randn(N, L, generator=g).to(device=device, dtype=dtype)
    return y, pos, w, du


def _both(y, pos, w, du, out_dtype):
    res = []
    for fn in (moe_combine_triton, moe_combine_torch):
        yy, ww = y.clone().requires_grad_(), w.clone().requires_grad_()
        u = fn(yy, pos, ww, out_dtype)
        u.backward(du)
        res.append((u.detach(), yy.grad, ww.grad))
    return res


def _assert_matches(res, tol_u, tol_dy):
    (u, dy, dw), (u_r, dy_r, dw_r) = res
    assert u.dtype == u_r.dtype and dy.dtype == dy_r.dtype and dw.dtype == dw_r.dtype
    assert rel_err(u.float(), u_r.float()) < tol_u
    assert rel_err(dy.float(), dy_r.float()) < tol_dy
    assert rel_err(dw, dw_r) < 1e-5


@pytest.mark.parametrize("N,k,L", [(37, 8, 200), (5, 3, 1030), (16, 1, 64)], ids=["k3-mini-like", "L-over-block", "k1"])
def test_interpreted_kernel_matches_reference_fp32(interpret, N, k, L):
    _assert_matches(_both(*_case(N, k, L, torch.float32), torch.float32), 1e-5, 1e-6)


def test_interpreted_kernel_matches_reference_bf16(interpret):
    _assert_matches(_both(*_case(29, 8, 256, torch.bfloat16, seed=1), torch.bfloat16), 2**-7, 2**-7)


def test_interpreted_kernel_zero_tokens_and_strided_gradient(interpret):
    y, pos, w, _ = _case(0, 4, 32, torch.float32)
    assert moe_combine_triton(y, pos, w, torch.float32).shape == (0, 32)
    # A non-contiguous incoming gradient (a transposed view) is accepted.
    y, pos, w, du = _case(6, 2, 48, torch.float32, seed=2)
    du_t = du.t().contiguous().t()
    _assert_matches(_both(y, pos, w, du_t, torch.float32), 1e-5, 1e-6)


def test_shapes_are_checked():
    y, pos, w, _ = _case(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="y must have shape"):
        moe_combine_torch(y[:-1], pos, w, torch.float32)
    with pytest.raises(ValueError, match="pos must be an integer tensor"):
        moe_combine_torch(y, pos.float(), w, torch.float32)
    with pytest.raises(ValueError, match="weights must be"):
        moe_combine_torch(y, pos, w[0], torch.float32)


def test_cpu_uses_the_reference_and_forcing_the_kernel_on_cpu_is_an_error(monkeypatch):
    y, pos, w, _ = _case(4, 2, 8, torch.float32)
    assert torch.equal(moe_combine(y, pos, w, torch.float32), moe_combine_torch(y, pos, w, torch.float32))
    monkeypatch.setenv("K3_MOE_COMBINE_BACKEND", "triton")
    with pytest.raises(ValueError, match="needs CUDA"):
        moe_combine(y, pos, w, torch.float32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_reference(dtype):
    # k3-mini's shape at 8K tokens: 8 of 128 experts, latent 512. bf16: one rounding of u and dy (2^-8).
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    _assert_matches(_both(*_case(8192, 8, 512, dtype, device="cuda"), dtype), tol, max(tol, 1e-6))
