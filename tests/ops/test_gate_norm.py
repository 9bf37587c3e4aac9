"""KDA's output RMSNorm times sigmoid(gate): the reference against the RMSNorm module, fla's fused kernel against
the reference (GPU, marked `gpu`), and the backend choice."""

import pytest
import torch

from helpers import rel_err
from k3.model.common import RMSNorm
from k3.ops.gate_norm import gate_norm, gate_norm_fla, gate_norm_torch
from k3.ops.registry import Backends


def test_reference_is_the_rmsnorm_module_times_the_gate():
    # bitwise: the same ops as the layer's RMSNorm on an fp32 input, then the sigmoid gate
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16))
    o, g = torch.randn(2, 5, 3, 16, dtype=torch.bfloat16), torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)
    y = gate_norm_torch(o, g, norm.weight, norm.eps)
    assert y.dtype == torch.float32
    assert torch.equal(y, norm(o.float()) * torch.sigmoid(g.float()))


def test_cpu_uses_the_reference_and_bad_shapes_are_named():
    o = torch.randn(4, 8)
    assert torch.equal(gate_norm(o, o, torch.ones(8), 1e-6), gate_norm_torch(o, o, torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match="same shape"):
        gate_norm(o, o[:, :4], torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        gate_norm(o, o, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="CUDA"):
        gate_norm(o, o, torch.ones(8), 1e-6, backends=Backends(per_op={"gate_norm": "fla"}))


def _fla_usable():
    if not torch.cuda.is_available():
        return False
    try:
        import fla.modules.norm.fused_norm_gate  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _fla_usable(), reason="needs CUDA and fla-core")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_fla_gated_norm_matches_the_reference_forward_and_backward(dtype, tol):
    # k3-mini's KDA output: 8 heads of 128, 2 x 1,000 tokens; the gate a strided view as the stacked projection
    # gives it. bf16: one rounding of y and of each gradient (2e-2 of the largest reference entry); fp32: 1e-5.
    g0 = torch.Generator().manual_seed(0)
    o = torch.randn(2, 1000, 8, 128, generator=g0).cuda()
    wide = torch.randn(2, 1000, 2 * 1024, generator=g0).cuda()
    w = (1 + 0.1 * torch.randn(128, generator=g0)).cuda()
    dy = torch.randn(2, 1000, 8, 128, generator=g0).cuda()
    res = {}
    for name, fn in (("fla", gate_norm_fla), ("torch", gate_norm_torch)):
        oi = o.to(dtype).requires_grad_()
        wi = wide.to(dtype).requires_grad_()
        gi = wi[..., 1024:].unflatten(-1, (8, 128))  # strided: rows of 2,048
        wt = w.clone().requires_grad_()
        y = fn(oi, gi, wt, 1e-6)
        (y.float() * dy).sum().backward()
        res[name] = (y.float(), oi.grad.float(), wi.grad[..., 1024:].float(), wt.grad.float())
    for a, b in zip(res["fla"], res["torch"]):
        assert rel_err(a, b) < tol
