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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_dispatch_backward_is_the_unit_weight_combine(interpret, dtype):
    # x = z[order // k]: the same rows as the PyTorch gather; dz sums each token's k slot gradients in fp32
    # (fp32: 1e-6; bf16: one ulp of the stored result, the interpreter truncating).
    from k3.ops.moe_combine import _Dispatch

    N, k, L = 23, 4, 96
    g = torch.Generator().manual_seed(5)
    z = torch.randn(N, L, generator=g).to(dtype)
    order = torch.randperm(N * k, generator=g)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(N * k)
    dx = torch.randn(N * k, L, generator=g).to(dtype)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    x1 = _Dispatch.apply(z1, order, pos, k)
    x2 = z2[:, None, :].expand(N, k, L).reshape(N * k, L)[order]
    assert torch.equal(x1, x2)
    x1.backward(dx)
    x2.backward(dx)
    assert z1.grad.dtype == dtype
    assert rel_err(z1.grad.float(), z2.grad.float()) < (1e-6 if dtype == torch.float32 else 2**-7)


def test_shapes_are_checked():
    y, pos, w, _ = _case(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="y must have shape"):
        moe_combine_torch(y[:-1], pos, w, torch.float32)
    with pytest.raises(ValueError, match="pos must be an integer tensor"):
        moe_combine_torch(y, pos.float(), w, torch.float32)
    with pytest.raises(ValueError, match="weights must be"):
        moe_combine_torch(y, pos, w[0], torch.float32)
    from k3.ops.moe_combine import moe_dispatch

    with pytest.raises(ValueError, match="order and pos must have shape"):
        moe_dispatch(torch.zeros(4, 8), pos, pos, 3)


def test_cpu_uses_the_reference_and_forcing_the_kernel_on_cpu_is_an_error():
    from k3.ops.registry import Backends

    y, pos, w, _ = _case(4, 2, 8, torch.float32)
    assert torch.equal(moe_combine(y, pos, w, torch.float32), moe_combine_torch(y, pos, w, torch.float32))
    with pytest.raises(ValueError, match="needs CUDA"):
        moe_combine(y, pos, w, torch.float32, backends=Backends(per_op={"moe_combine": "triton"}))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_reference(dtype):
    # k3-mini's shape at 8K tokens: 8 of 128 experts, latent 512. bf16: u and dy are each rounded once from fp32
    # sums taken in another order, so an entry may land one bf16 step away: up to 2^-7 of the largest entry.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    _assert_matches(_both(*_case(8192, 8, 512, dtype, device="cuda"), dtype), tol, max(tol, 1e-6))


@pytest.mark.gpu
@needs_cuda
def test_gpu_grouped_moe_layer_with_the_kernels_matches_the_pytorch_permutations():
    # The whole grouped MoE (k3-mini's experts, 4K tokens, bf16) with dispatch backward and combine on the kernel
    # against the same layer with PyTorch's gather/scatter: output and every gradient within 1e-2 relative.
    from k3.model.latent_moe import GroupedExperts
    from k3.ops.moe import moe_experts_grouped, route
    from k3.ops.registry import Backends

    torch.manual_seed(0)
    ex = GroupedExperts(128, 512, 768, 4.0, 25.0).cuda()
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.02)
    logits = torch.randn(4096, 128, device="cuda")
    z0 = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    du = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    res = {}
    for be in ("triton", "torch"):
        z, lg = z0.clone().requires_grad_(), logits.clone().requires_grad_()
        r = route(lg, None, 8)
        u = moe_experts_grouped(z, r.weights, r.indices, ex.w1, ex.w3, ex.w2, ex.act_fused,
                                backends=Backends(per_op={"moe_combine": be}))
        grads = torch.autograd.grad((u.float() * du.float()).sum(), [z, lg, ex.w1, ex.w3, ex.w2])
        res[be] = (u, *grads)
    for a, b in zip(res["triton"], res["torch"]):
        assert rel_err(a.float(), b.float()) < 1e-2
