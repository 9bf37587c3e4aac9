"""Per-Head Muon's fused momentum and update kernels (k3.ops.muon_update) against their PyTorch passes.

CPU tests run the kernels in Triton's interpreter (TRITON_INTERPRET=1, read at each call); the GPU test (marked
`gpu`) runs the compiled kernels. Tolerances: fp32 results within 1e-6 relative (one fused multiply-add instead of
a multiply and an add); bf16 Newton-Schulz inputs within one bf16 step (2^-7 relative: the interpreter truncates
where the compiled kernel rounds)."""

import pytest
import torch

from k3.ops.muon_update import decay_add_, decay_add_torch, momentum_, momentum_torch


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _close(a, b, tol):
    a, b = a.double(), b.double()
    assert float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) <= tol


def _momentum_case(device, u_dtype, nesterov, n=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    grad, buf = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    out = {}
    for name, fn in (("kernel", momentum_), ("torch", momentum_torch)):
        b, u = buf.clone(), torch.empty(n, device=device, dtype=u_dtype)
        fn(grad, b, u, 0.95, nesterov)
        out[name] = (b, u)
    return out


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("u_dtype", [torch.float32, torch.bfloat16])
def test_momentum_matches_the_torch_passes(interpret, nesterov, u_dtype):
    out = _momentum_case("cpu", u_dtype, nesterov)  # 5000 elements: the last program is partial
    _close(out["kernel"][0], out["torch"][0], 1e-6)
    _close(out["kernel"][1], out["torch"][1], 1e-6 if u_dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous-o", "transposed-o"])
def test_decay_add_matches_the_torch_passes(interpret, transposed):
    # [n, R, C] blocks, sizes off the tile grid; o as Newton-Schulz returns it for tall blocks: a transposed view
    g = torch.Generator().manual_seed(1)
    p = torch.randn(3, 70, 45, generator=g)
    o = torch.randn(3, 45, 70, generator=g).mT if transposed else torch.randn(3, 70, 45, generator=g)
    a, b = p.clone(), p.clone()
    decay_add_(a, o, 0.999, -0.02)
    decay_add_torch(b, o, 0.999, -0.02)
    _close(a, b, 1e-6)


def test_bad_inputs_are_named(interpret):
    with pytest.raises(ValueError, match="same number of elements"):
        momentum_(torch.zeros(4), torch.zeros(5), torch.zeros(5), 0.9, True)
    with pytest.raises(ValueError, match="contiguous"):
        momentum_(torch.zeros(4, 4).t(), torch.zeros(4, 4), torch.zeros(4, 4), 0.9, True)
    with pytest.raises(ValueError, match="same shape"):
        decay_add_(torch.zeros(2, 3, 4), torch.zeros(2, 4, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        decay_add_(torch.zeros(2, 4, 3).mT, torch.zeros(2, 3, 4), 1.0, 1.0)


def test_needs_cuda_or_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="cannot run"):
        momentum_(torch.zeros(4), torch.zeros(4), torch.zeros(4), 0.9, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernels_match_the_torch_passes():
    for nesterov in (True, False):
        out = _momentum_case("cuda", torch.bfloat16, nesterov, n=3_000_001)
        _close(out["kernel"][0], out["torch"][0], 1e-6)
        _close(out["kernel"][1], out["torch"][1], 2 ** -7)  # one bf16 step at the largest entry
    g = torch.Generator().manual_seed(2)
    for o in (torch.randn(64, 512, 768, generator=g), torch.randn(64, 768, 512, generator=g).mT):
        p = torch.randn(64, 512, 768, generator=g).cuda()
        a, b = p.clone(), p.clone()
        oc = o.cuda().bfloat16()  # keeps the transposed view's strides
        assert oc.stride() == o.stride()
        decay_add_(a, oc, 0.999, -0.02)
        decay_add_torch(b, oc, 0.999, -0.02)
        _close(a, b, 1e-6)


def test_asking_for_the_kernels_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    # through the optimizer: muon=triton with CPU parameters and no interpreter names the problem
    pytest.importorskip("triton")
    from k3.ops.registry import Backends
    from k3.train.per_head_muon import PerHeadMuon, muon_param_groups

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lin = torch.nn.Linear(8, 8, bias=False)
    lin.weight.grad = torch.randn(8, 8)
    with pytest.raises(ValueError, match="muon=triton.*CUDA"):
        PerHeadMuon(muon_param_groups(lin), lr=0.1, backends=Backends(per_op={"muon": "triton"})).step()
