"""SiTU-GLU (report §2.3.2, appendix B)."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3.ops.situ import situ_glu


def test_bounded_by_beta1_beta2_and_bound_is_approached():
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(4096, generator=g) * 1e4
    up = torch.randn(4096, generator=g) * 1e4
    out = situ_glu(gate, up)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 4.0 * 25.0

    # The cap is reached for large positive gate and large |up| (exactly, once tanh saturates in fp32).
    grid = torch.linspace(-200.0, 200.0, 401)
    out = situ_glu(grid[:, None].expand(401, 401), grid[None, :].expand(401, 401))
    assert out.abs().max() <= 100.0
    assert out.abs().max() > 0.99 * 100.0
    # Custom betas: the bound follows them.
    out = situ_glu(torch.full((3,), 1e3), torch.tensor([-1e3, 0.0, 1e3]), beta1=2.0, beta2=3.0)
    torch.testing.assert_close(out, torch.tensor([-6.0, 0.0, 6.0]), rtol=1e-6, atol=0.0)


def test_matches_swiglu_near_origin():
    g = torch.Generator().manual_seed(1)
    gate = (torch.rand(10000, generator=g, dtype=torch.float64) * 2 - 1) * 0.1
    up = (torch.rand(10000, generator=g, dtype=torch.float64) * 2 - 1) * 0.1
    gate = gate.masked_fill(gate.abs() < 1e-6, 1e-3)  # stay away from 0/0 in the relative diff
    up = up.masked_fill(up.abs() < 1e-6, 1e-3)
    swiglu = F.silu(gate) * up
    rel = ((situ_glu(gate, up) - swiglu).abs() / swiglu.abs()).max()
    # beta*tanh(x/beta) = x (1 - x^2 / (3 beta^2) + ...): at |x| < 0.1 the gap is < 1e-3.
    assert rel < 1e-2


def test_closed_form_values():
    def expected(gv, uv, b1=4.0, b2=25.0):
        return b1 * math.tanh(gv / b1) / (1 + math.exp(-gv)) * b2 * math.tanh(uv / b2)

    points = [(0.0, 5.0), (1.0, 1.0), (-2.0, 3.0), (4.0, -25.0), (10.0, 50.0)]
    gate = torch.tensor([p[0] for p in points], dtype=torch.float64)
    up = torch.tensor([p[1] for p in points], dtype=torch.float64)
    want = torch.tensor([expected(a, b) for a, b in points], dtype=torch.float64)
    torch.testing.assert_close(situ_glu(gate, up), want, rtol=1e-12, atol=1e-12)
    assert situ_glu(torch.zeros(1), torch.full((1,), 7.0)).item() == 0.0
    # fp32 path: same numbers within fp32 rounding.
    torch.testing.assert_close(situ_glu(gate.float(), up.float()), want.float(), rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    gate = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 5).requires_grad_()
    up = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (gate, up))
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 1.5, 2.0), (gate, up))


def test_bf16_in_bf16_out():
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(64, 32, generator=g) * 3
    up = torch.randn(64, 32, generator=g) * 10
    out = situ_glu(gate.bfloat16(), up.bfloat16())
    assert out.dtype == torch.bfloat16
    ref = situ_glu(gate.bfloat16().float(), up.bfloat16().float())
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_validation():
    with pytest.raises(ValueError, match="same shape"):
        situ_glu(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="gate must be a floating"):
        situ_glu(torch.zeros(2, dtype=torch.long), torch.zeros(2))
    with pytest.raises(ValueError, match="beta1"):
        situ_glu(torch.zeros(2), torch.zeros(2), beta1=0.0)
    with pytest.raises(ValueError, match="beta2"):
        situ_glu(torch.zeros(2), torch.zeros(2), beta2=-1.0)
