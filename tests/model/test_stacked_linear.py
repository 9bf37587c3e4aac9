"""k3.model.common.stacked_linear: several projections of one input as one GEMM."""

import torch
from torch import nn

from k3.model.common import stacked_linear


def test_equals_the_separate_projections_with_their_gradients():
    # fp32 on CPU: the same dot products, so 1e-6 relative; the stack of 3 + 5 + 7 = 15 rows is padded to 16,
    # and the views' row stride is that aligned width
    torch.manual_seed(0)
    layers = [nn.Linear(12, n, bias=False) for n in (3, 5, 7)]
    x = torch.randn(2, 9, 12, requires_grad=True)
    outs = stacked_linear(x, *layers)
    assert [o.shape[-1] for o in outs] == [3, 5, 7] and outs[0].stride(-2) == 16
    dys = [torch.randn_like(o) for o in outs]
    sum((o * d).sum() for o, d in zip(outs, dys)).backward()
    got = [x.grad.clone()] + [layer.weight.grad.clone() for layer in layers]
    x.grad = None
    for layer in layers:
        layer.weight.grad = None
    refs = [layer(x) for layer in layers]
    sum((r * d).sum() for r, d in zip(refs, dys)).backward()
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    for g, r in zip(got, [x.grad] + [layer.weight.grad for layer in layers]):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_no_padding_when_aligned_and_autocast_gives_bf16_views():
    layers = [nn.Linear(8, 16, bias=False), nn.Linear(8, 32, bias=False)]
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = stacked_linear(x, *layers)
    assert a.dtype == b.dtype == torch.bfloat16 and a.stride(0) == 48


def test_without_gradients_the_layers_run_one_by_one():
    # inference: no stacked copy of the weights, the plain per-layer results (contiguous)
    layers = [nn.Linear(8, 5, bias=False), nn.Linear(8, 7, bias=False)]
    x = torch.randn(3, 8)
    with torch.no_grad():
        outs = stacked_linear(x, *layers)
        assert all(torch.equal(o, layer(x)) for o, layer in zip(outs, layers))
    assert all(o.is_contiguous() for o in outs)


def test_a_tuple_of_layers_gives_their_outputs_side_by_side():
    # (a, b) as one entry: one output equal to cat([a(x), b(x)], -1), with gradients (fp32, 1e-6) and without
    torch.manual_seed(1)
    a, b, c = (nn.Linear(6, n, bias=False) for n in (4, 4, 3))
    x = torch.randn(5, 6, requires_grad=True)
    ab, cc = stacked_linear(x, (a, b), c)
    assert ab.shape == (5, 8) and cc.shape == (5, 3)
    torch.testing.assert_close(ab, torch.cat([a(x), b(x)], -1), rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(ab)
    (ab * dy).sum().backward()
    ga, gb = a.weight.grad.clone(), b.weight.grad.clone()
    a.weight.grad = b.weight.grad = None
    (torch.cat([a(x), b(x)], -1) * dy).sum().backward()
    torch.testing.assert_close(ga, a.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb, b.weight.grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        ab2, cc2 = stacked_linear(x, (a, b), c)
        assert torch.equal(ab2, torch.cat([a(x), b(x)], -1)) and torch.equal(cc2, c(x))
