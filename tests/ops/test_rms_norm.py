"""The RMSNorm kernel (backend op ``rms_norm``) against the model's RMSNorm definition, forward and backward.

CPU tests run the kernels in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` test runs them
compiled at k3-mini's shape. Tolerances, relative to the largest reference entry: on GPU, outputs and input
gradients one bf16 step (2^-7: both sides round the same fp32 values; the norm's sum runs in another order) and the
weight's gradient (an fp32 sum over rows in another order) 1e-4; in the interpreter, which rounds to bf16 by
truncation, two bf16 steps (x_hat and y, g and dx are each rounded once) and 1e-2 for the weight's gradient.
"""

import pytest
import torch

from helpers import rel_err
from k3.ops.rms_norm import rms_norm_any, rms_norm_reference, rms_norm_triton


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(shape, device="cpu", dtype=torch.bfloat16, seed=0, weight_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3 + 0.5).to(device, dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(device, weight_dtype).requires_grad_()
    dy = torch.randn(*shape, generator=g).to(device, dtype)
    return x, w, dy


def _compare(x, w, dy, fn, tol_y, tol_dw):
    y_ref = rms_norm_reference(x, w, 1e-5)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, [x, w], dy)
    y = fn(x, w, 1e-5)
    gx, gw = torch.autograd.grad(y, [x, w], dy)
    assert y.dtype == x.dtype and y.shape == x.shape and gx.dtype == x.dtype and gw.dtype == w.dtype
    assert rel_err(y.float(), y_ref.float()) <= tol_y
    assert rel_err(gx.float(), gx_ref.float()) <= tol_y
    assert rel_err(gw, gw_ref) < tol_dw


@pytest.mark.parametrize("shape", [(3, 5, 64), (130, 96), (1, 1, 1000)], ids=["3d", "rows>ROWS,D<block", "1row"])
def test_interpreted_kernel_matches_the_definition(interpret, shape):
    _compare(*_inputs(shape), rms_norm_triton, 2 ** -6, 1e-2)


def test_interpreted_kernel_fp16(interpret):
    _compare(*_inputs((20, 64), dtype=torch.float16), rms_norm_triton, 2 ** -9, 1e-2)  # two fp16 steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interpreted_kernel_with_a_weight_of_the_activations_dtype(interpret, dtype):
    # a served bf16 model's norms: the weight in x's dtype. The product of two bf16 (fp16) values is exact in fp32,
    # so the kernel's rounded fp32 product is the reference's bf16 multiply; the weight's gradient, which the
    # reference sums in bf16 (the kernel in fp32), within one step of its dtype
    step = 2 ** -6 if dtype == torch.bfloat16 else 2 ** -9
    _compare(*_inputs((130, 96), dtype=dtype, weight_dtype=dtype), rms_norm_triton, step, 2 * step)
    x, w, _ = _inputs((5, 64), dtype=dtype, weight_dtype=dtype)
    assert torch.equal(rms_norm_any(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))  # CPU: the reference
    with pytest.raises(ValueError, match="fp32 weight or one of x's dtype"):
        rms_norm_triton(x, w.detach().to(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16), 1e-5)


def test_model_rmsnorm_uses_the_definition_off_cuda_and_checks_inputs():
    from k3.model.common import RMSNorm

    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.mul_(1.5)
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, norm.eps))
    assert torch.equal(rms_norm_any(x, norm.weight, norm.eps), rms_norm_reference(x, norm.weight, norm.eps))
    with pytest.raises(ValueError, match="bf16/fp16 x and an fp32 weight"):
        rms_norm_triton(x.float(), norm.weight, 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \[64\]"):
        rms_norm_triton(x, norm.weight[:32].detach(), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4, 8192, 1024), (32768, 512), (7, 3, 1024)], ids=["k3-mini", "latent", "small"])
def test_kernel_matches_the_definition_on_gpu(shape):
    _compare(*_inputs(shape, "cuda"), rms_norm_triton, 2 ** -7, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_kernel_with_a_bf16_weight_on_gpu(rows):
    # a served model's decode and prefill norms (bf16 weight, k3-mini's hidden size)
    _compare(*_inputs((rows, 1024), "cuda", weight_dtype=torch.bfloat16), rms_norm_triton, 2 ** -7, 2 ** -7)
