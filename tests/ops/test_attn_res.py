"""Block Attention Residuals (report §2.2): direct and two-phase forms."""

import pytest
import torch

from helpers import rel_err
from k3.ops.attn_res import AttnResPartial, attn_res, attn_res_inter, attn_res_merge


def reference_attn_res(sources, w, eps=1e-5):
    """Float64, one source at a time."""
    v = [s.double() for s in sources]
    scores = torch.stack([(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).sum(-1) for x in v])
    p = torch.softmax(scores, dim=0)
    return sum(p[i][..., None] * v[i] for i in range(len(v)))


def assert_rel(actual, expected, tol=1e-5):
    """max |actual - expected| <= tol * max |expected| (relative to the tensor's scale)."""
    err = (actual.double() - expected.double()).abs().max()
    assert err <= tol * expected.double().abs().max(), f"max error {err:.3e} vs scale {expected.abs().max():.3e}"


def make_sources(gen, n, shape, dtype=torch.float32):
    # Different magnitudes per source, as residual streams have.
    return [(torch.randn(*shape, generator=gen) * (0.5 + i)).to(dtype) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("shape", [(16,), (2, 3, 32), (4, 64)])
def test_direct_matches_float64_reference(n, shape):
    g = torch.Generator().manual_seed(n * 100 + len(shape))
    sources = make_sources(g, n, shape)
    w = torch.randn(shape[-1], generator=g)
    out = attn_res(sources, w)
    assert out.shape == shape and out.dtype == torch.float32
    assert_rel(out, reference_attn_res(sources, w))
    # Tensor [N, ..., D] and list inputs agree exactly.
    assert torch.equal(attn_res(torch.stack(sources), w), out)


@pytest.mark.parametrize("n_blocks", [1, 2, 4, 7])
@pytest.mark.parametrize("shape", [(32,), (2, 5, 48)])
def test_two_phase_equals_direct(n_blocks, shape):
    g = torch.Generator().manual_seed(10 * n_blocks + len(shape))
    S, D = 3, shape[-1]
    blocks = make_sources(g, n_blocks, shape)
    ws = torch.randn(S, D, generator=g) * 2
    partial = attn_res_inter(blocks, ws)
    assert isinstance(partial, AttnResPartial)
    assert partial.m.shape == (S, *shape[:-1]) and partial.l.shape == (S, *shape[:-1])
    assert partial.acc.shape == (S, *shape) and partial.acc.dtype == torch.float32
    for site in range(S):
        current = torch.randn(*shape, generator=g) * 3
        merged = attn_res_merge(partial, site, current, ws[site])
        direct = attn_res(blocks + [current], ws[site])
        assert_rel(merged, direct)
        assert_rel(merged, reference_attn_res(blocks + [current], ws[site]))
    # Tensor input for the blocks gives the same statistics.
    partial2 = attn_res_inter(torch.stack(blocks), ws)
    for a, b in zip(partial, partial2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_two_phase_when_current_dominates_or_is_negligible():
    # The online-softmax rescaling must hold when the new score is far above or below the running max.
    g = torch.Generator().manual_seed(5)
    D = 16
    blocks = make_sources(g, 3, (4, D))
    ws = torch.randn(2, D, generator=g) * 20
    partial = attn_res_inter(blocks, ws)
    for site, sign in ((0, 1.0), (1, -1.0)):
        current = sign * ws[site].expand(4, D).clone()  # aligned (or anti-aligned) with the query
        assert_rel(attn_res_merge(partial, site, current, ws[site]), attn_res(blocks + [current], ws[site]))


def test_zero_query_is_plain_mean():
    g = torch.Generator().manual_seed(6)
    sources = make_sources(g, 4, (3, 8))
    w = torch.zeros(8)
    torch.testing.assert_close(attn_res(sources, w), torch.stack(sources).mean(0), rtol=1e-6, atol=1e-6)
    partial = attn_res_inter(sources[:3], w[None])
    assert torch.equal(partial.m, torch.zeros(1, 3)) and torch.equal(partial.l, torch.full((1, 3), 3.0))
    merged = attn_res_merge(partial, 0, sources[3], w)
    torch.testing.assert_close(merged, torch.stack(sources).mean(0), rtol=1e-6, atol=1e-6)


def test_positive_scale_keeps_score_but_changes_output():
    g = torch.Generator().manual_seed(7)
    D = 32
    sources = make_sources(g, 3, (D,))
    w = torch.randn(D, generator=g)
    scaled = [sources[0], sources[1] * 7.5, sources[2]]
    # RMSNorm invariance (up to eps): the softmax statistics of the scaled set are the same.
    p1 = attn_res_inter(sources, w[None])
    p2 = attn_res_inter(scaled, w[None])
    torch.testing.assert_close(p1.m, p2.m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1.l, p2.l, rtol=1e-5, atol=1e-5)
    # ... so the output moves exactly by weight_1 * 6.5 * v_1 (the raw source is mixed).
    out1, out2 = attn_res(sources, w), attn_res(scaled, w)
    assert not torch.allclose(out1, out2)
    weights = torch.softmax(
        torch.stack([(s / s.pow(2).mean().add(1e-5).sqrt() * w).sum() for s in sources]), dim=0
    )
    torch.testing.assert_close(out2 - out1, weights[1] * 6.5 * sources[1], rtol=1e-4, atol=1e-5)


def test_bf16_sources_return_bf16():
    g = torch.Generator().manual_seed(8)
    sources = make_sources(g, 4, (6, 64), dtype=torch.bfloat16)
    w = torch.randn(64, generator=g)
    out = attn_res(sources, w)
    assert out.dtype == torch.bfloat16
    ref = attn_res([s.float() for s in sources], w)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    partial = attn_res_inter(sources[:3], torch.stack([w, -w]))
    assert partial.acc.dtype == torch.float32
    merged = attn_res_merge(partial, 0, sources[3], w)
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.float(), ref, rtol=1e-2, atol=1e-2)


def test_single_source_returns_it():
    g = torch.Generator().manual_seed(9)
    v = torch.randn(2, 5, 16, generator=g)
    w = torch.randn(16, generator=g) * 10
    assert torch.equal(attn_res([v], w), v)
    assert torch.equal(attn_res(v[None], w), v)


def test_validation():
    v = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="w must have shape"):
        attn_res(v, torch.zeros(7))
    with pytest.raises(ValueError, match=r"sources\[1\] must be a tensor of shape"):
        attn_res([torch.zeros(4, 8), torch.zeros(4, 9)], torch.zeros(8))
    with pytest.raises(ValueError, match="at least one source"):
        attn_res([], torch.zeros(8))
    with pytest.raises(ValueError, match="ws must have shape"):
        attn_res_inter(v, torch.zeros(8))
    partial = attn_res_inter(v, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="site must be"):
        attn_res_merge(partial, 2, torch.zeros(4, 8), torch.zeros(8))
    with pytest.raises(ValueError, match="current must have shape"):
        attn_res_merge(partial, 0, torch.zeros(5, 8), torch.zeros(8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fla_fused_matches_reference_forward_and_backward(dtype, tol):
    from k3.ops.attn_res import attn_res_fla, fla_available
    from k3.ops.registry import Target

    ok, why = fla_available(Target(torch.device("cuda")))
    if not ok:
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    srcs = [(torch.randn(2, 333, 1024, generator=g) * (1 + i)).cuda().to(dtype).requires_grad_() for i in range(6)]
    w = torch.randn(1024, generator=g).cuda().requires_grad_()
    dy = torch.randn(2, 333, 1024, generator=g).cuda()
    out = {}
    for name, fn in (("ref", attn_res), ("fla", attn_res_fla)):
        o = fn(srcs, w, 1e-5)
        grads = torch.autograd.grad((o.float() * dy).sum(), [*srcs, w])
        out[name] = (o, grads)
    assert rel_err(out["fla"][0].float(), out["ref"][0].float()) < tol
    for a, b in zip(out["fla"][1], out["ref"][1]):
        assert rel_err(a.float(), b.float()) < tol * 3
