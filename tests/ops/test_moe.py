"""Sigmoid router and latent MoE dispatch/combine (report §2.3, §2.3.3)."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops.moe import Routing, expert_load, moe_experts, route
from k3.ops.situ import situ_glu


def swiglu(gate, up):
    return F.silu(gate) * up


# ------------------------------------------------------------------------- route


def test_route_shapes_and_weights_are_renormalized_unbiased_scores():
    g = torch.Generator().manual_seed(0)
    N, E, k = 32, 16, 4
    logits = torch.randn(N, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    r = route(logits, bias, k, scaling_factor=2.5)
    assert isinstance(r, Routing)
    assert r.weights.shape == (N, k) and r.weights.dtype == torch.float32
    assert r.indices.shape == (N, k) and r.indices.dtype == torch.int64
    assert r.scores.shape == (N, E) and r.cutoff.shape == (N,)
    scores = torch.sigmoid(logits)
    torch.testing.assert_close(r.scores, scores, rtol=0, atol=0)
    selected = scores.gather(1, r.indices)
    torch.testing.assert_close(r.weights, 2.5 * selected / selected.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert (r.weights.sum(-1) - 2.5).abs().max() <= 1e-6 * 2.5
    # Unrenormalized: the raw unbiased scores times the factor.
    r2 = route(logits, bias, k, renormalize=False, scaling_factor=2.5)
    assert torch.equal(r2.indices, r.indices)
    torch.testing.assert_close(r2.weights, 2.5 * selected, rtol=1e-6, atol=0)


def test_weights_ignore_the_bias_magnitude():
    g = torch.Generator().manual_seed(1)
    N, E, k = 20, 8, 2
    logits = torch.randn(N, E, generator=g)
    scores = torch.sigmoid(logits)
    # Biases of very different magnitudes that all force experts {3, 6}: same selection,
    # bit-identical weights, equal to the renormalized unbiased scores of {3, 6}.
    results = []
    for mag in (2.0, 50.0, 1e4):
        bias = torch.zeros(E)
        bias[[3, 6]] = mag
        r = route(logits, bias, k)
        assert torch.equal(r.indices.sort(-1).values, torch.tensor([3, 6]).expand(N, k))
        want = scores.gather(1, r.indices)
        torch.testing.assert_close(r.weights, want / want.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
        results.append(r)
    # (The order of the two inside top-k may differ at 1e4 where fp32 rounds the biased scores.)
    by_expert = [r.weights.gather(1, r.indices.argsort(-1)) for r in results]
    for w in by_expert[1:]:
        assert torch.equal(w, by_expert[0])
    # A constant shift does not change the order: same routes and weights as no bias.
    base = route(logits, None, k)
    r = route(logits, torch.full((E,), 123.0), k)
    assert torch.equal(r.indices, base.indices) and torch.equal(r.weights, base.weights)


def test_large_positive_bias_forces_expert_into_every_selection():
    g = torch.Generator().manual_seed(2)
    N, E, k = 64, 12, 3
    logits = torch.randn(N, E, generator=g) * 4
    bias = torch.zeros(E)
    bias[7] = 10.0  # sigmoid scores are in (0, 1): a bias > 1 always wins
    r = route(logits, bias, k)
    assert (r.indices == 7).any(dim=1).all()
    assert (r.indices[:, 0] == 7).all()  # it is the top pick


def test_cutoff_is_k_plus_first_biased_score():
    g = torch.Generator().manual_seed(3)
    N, E, k = 40, 10, 3
    logits = torch.randn(N, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.3
    r = route(logits, bias, k)
    biased = torch.sigmoid(logits) + bias
    want = biased.sort(dim=-1, descending=True).values[:, k]
    assert torch.equal(r.cutoff, want)
    assert (biased.gather(1, r.indices) >= r.cutoff[:, None]).all()
    # Every unselected expert is at or below the cutoff.
    unselected = torch.ones(N, E, dtype=torch.bool).scatter(1, r.indices, False)
    assert (biased[unselected].view(N, E - k) <= r.cutoff[:, None]).all()
    # k == E: everything is selected and the cutoff is -inf.
    r_all = route(logits, bias, E)
    assert torch.isinf(r_all.cutoff).all() and (r_all.cutoff < 0).all()
    assert torch.equal(r_all.indices.sort(-1).values, torch.arange(E).expand(N, E))


def test_expert_load_counts():
    g = torch.Generator().manual_seed(4)
    N, E, k = 50, 9, 3
    r = route(torch.randn(N, E, generator=g), None, k)
    load = expert_load(r.indices, E)
    assert load.shape == (E,) and load.dtype == torch.int64
    assert int(load.sum()) == N * k
    assert torch.equal(load, torch.tensor([(r.indices == e).sum() for e in range(E)]))
    with pytest.raises(ValueError, match="indices must lie in"):
        expert_load(torch.tensor([[0, 9]]), 9)


def test_route_validation():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(2, 4), None, 5)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(2, 4), None, 0)
    with pytest.raises(ValueError, match="bias"):
        route(torch.zeros(2, 4), torch.zeros(3), 2)
    with pytest.raises(ValueError, match="logits"):
        route(torch.zeros(2, 4, 1), None, 2)


# -------------------------------------------------------------------- moe_experts


def loop_reference(z, weights, indices, w1, w3, w2, act):
    """One token, one selected expert at a time."""
    rows = []
    for n in range(z.shape[0]):
        u = torch.zeros_like(z[n])
        for j in range(indices.shape[1]):
            e = int(indices[n, j])
            u = u + weights[n, j] * (w2[e] @ act(w1[e] @ z[n], w3[e] @ z[n]))
        rows.append(u)
    return torch.stack(rows)


def make_experts(gen, E, F_, L):
    w1 = torch.randn(E, F_, L, generator=gen) * L**-0.5
    w3 = torch.randn(E, F_, L, generator=gen) * L**-0.5
    w2 = torch.randn(E, L, F_, generator=gen) * F_**-0.5
    return w1, w3, w2


def assert_rel(actual, expected, tol=1e-5):
    err = (actual.double() - expected.double()).abs().max()
    assert err <= tol * expected.double().abs().max(), f"max error {err:.3e}"


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("act", [situ_glu, swiglu])
def test_moe_experts_matches_per_token_loop(k, act):
    g = torch.Generator().manual_seed(5)
    N, E, F_, L = 24, 8, 16, 12
    z = torch.randn(N, L, generator=g) * 2
    w1, w3, w2 = make_experts(g, E, F_, L)
    bias = torch.zeros(E)
    bias[[2, 5]] = -10.0  # experts 2 and 5 receive no tokens
    r = route(torch.randn(N, E, generator=g), bias, k)
    load = expert_load(r.indices, E)
    assert load[2] == 0 and load[5] == 0
    u = moe_experts(z, r.weights, r.indices, w1, w3, w2, act)
    assert u.shape == (N, L) and u.dtype == torch.float32
    assert_rel(u, loop_reference(z, r.weights, r.indices, w1, w3, w2, act))


def test_moe_experts_gradients_match_per_token_loop():
    g = torch.Generator().manual_seed(6)
    N, E, F_, L, k = 10, 5, 8, 6, 2
    z0 = torch.randn(N, L, generator=g)
    experts0 = make_experts(g, E, F_, L)
    logits0 = torch.randn(N, E, generator=g)
    upstream = torch.randn(N, L, generator=g)

    def grads(fn):
        z = z0.clone().requires_grad_()
        w1, w3, w2 = (w.clone().requires_grad_() for w in experts0)
        logits = logits0.clone().requires_grad_()
        r = route(logits, None, k)
        (fn(z, r.weights, r.indices, w1, w3, w2, situ_glu) * upstream).sum().backward()
        return [t.grad for t in (z, w1, w3, w2, logits)]

    got, want = grads(moe_experts), grads(loop_reference)
    for name, a, b in zip(("z", "w1", "w3", "w2", "logits"), got, want):
        assert a is not None and a.abs().sum() > 0, name
        assert_rel(a, b)


def test_moe_experts_bf16():
    g = torch.Generator().manual_seed(7)
    N, E, F_, L, k = 16, 4, 32, 16, 2
    z = torch.randn(N, L, generator=g)
    w1, w3, w2 = make_experts(g, E, F_, L)
    r = route(torch.randn(N, E, generator=g), None, k)
    u = moe_experts(z.bfloat16(), r.weights, r.indices, w1.bfloat16(), w3.bfloat16(), w2.bfloat16(), situ_glu)
    assert u.dtype == torch.bfloat16
    as_bf16 = [t.bfloat16().float() for t in (z, w1, w3, w2)]  # the same rounded inputs, in fp32
    ref = loop_reference(as_bf16[0], r.weights, r.indices, *as_bf16[1:], situ_glu)
    assert_rel(u, ref, tol=2e-2)


def test_moe_experts_validation():
    z = torch.zeros(4, 6)
    w1 = w3 = torch.zeros(3, 8, 6)
    w2 = torch.zeros(3, 6, 8)
    idx = torch.zeros(4, 2, dtype=torch.long)
    wts = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe_experts(z, wts, idx, w1, w3, torch.zeros(3, 8, 6), situ_glu)
    with pytest.raises(ValueError, match="weights must be"):
        moe_experts(z, torch.zeros(4, 3), idx, w1, w3, w2, situ_glu)
    with pytest.raises(ValueError, match="indices must lie in"):
        moe_experts(z, wts, idx + 3, w1, w3, w2, situ_glu)
    with pytest.raises(ValueError, match="w1 must have shape"):
        moe_experts(z, wts, idx, torch.zeros(3, 8, 5), w3, w2, situ_glu)
