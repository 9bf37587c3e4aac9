"""The chunked head cross-entropy with its gradient in the forward (k3.ops.linear_ce) against plain autograd."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from k3.ops.linear_ce import linear_cross_entropy


def _case(N=300, D=32, V=97, seed=0, ignore_every=7):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.3
    t = torch.randint(0, V, (N,), generator=g)
    t[::ignore_every] = -100
    return h, w, t


def _reference(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk", [1000, 64, 7], ids=["one-chunk", "chunks", "small-chunks"])
def test_loss_and_gradients_equal_autograd_fp32(chunk):
    # fp32: the same math in another order, 1e-6 relative (loss, d(h), d(W)); the incoming gradient is applied.
    h, w, t = _case()
    res = []
    for fn in (lambda a, b: linear_cross_entropy(a, b, t, chunk_tokens=chunk), lambda a, b: _reference(a, b, t)):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(a, b)
        (loss * 0.5).backward()
        res.append((loss.detach(), a.grad, b.grad))
    for x, y in zip(*res):
        assert rel_err(x, y) < 1e-6


def test_under_bf16_autocast_matches_autograd_on_the_same_rounding():
    # Under autocast the head GEMMs run in bf16 on both sides (logits rounded to bf16, then fp32): loss to 1e-5,
    # gradients within bf16 rounding (1e-2); parameter gradient in fp32, input gradient in the input's dtype.
    h, w, t = _case(N=256, D=64, V=128, seed=1)
    res = []
    for fn in (lambda a, b: linear_cross_entropy(a, b, t, chunk_tokens=100), lambda a, b: _reference(a, b, t)):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(a, b)
        loss.backward()
        res.append((loss.detach(), a.grad, b.grad))
    assert res[0][1].dtype == torch.float32 and res[0][2].dtype == torch.float32
    assert rel_err(res[0][0], res[1][0]) < 1e-5
    for x, y in zip(res[0][1:], res[1][1:]):
        assert rel_err(x, y) < 1e-2


def test_without_gradients_only_the_loss_is_computed():
    h, w, t = _case(seed=2)
    with torch.no_grad():
        assert rel_err(linear_cross_entropy(h, w, t, chunk_tokens=50), _reference(h, w, t)) < 1e-6
    assert not linear_cross_entropy(h, w, t).requires_grad


def test_bad_shapes_are_named():
    h, w, t = _case(N=10)
    with pytest.raises(ValueError, match="target must have shape"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="h must be"):
        linear_cross_entropy(h, w[:, :-1], t)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, w, t, chunk_tokens=0)
