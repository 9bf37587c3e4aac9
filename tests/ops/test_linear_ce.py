"""The chunked head cross-entropy with its gradient in the forward (k3.ops.linear_ce) against plain autograd."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from k3.ops.linear_ce import linear_cross_entropy
from k3.ops.registry import Backends


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


# --- the cross-entropy gradient kernel (op ``linear_ce``: triton) ------------------------------------------------
# CPU tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` tests run it
# compiled at k3-mini's head shapes. Tolerances: fp32, 1e-6 relative to the largest reference entry (only the order
# of the exponential sums differs); bf16 gradients one bf16 step of the largest entry (2^-7: both sides round the
# same fp32 value, the interpreter by truncation).

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _logits(n, V, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, V, generator=g) * 3).to(device=device, dtype=dtype)
    t = torch.randint(0, V, (n,), generator=g).to(device)
    t[::5] = -100
    return x, t


def _kernel_vs_reference(x, t, tol):
    from k3.ops.linear_ce import ce_grad_torch_, ce_grad_triton_

    ref_loss, ref_g = ce_grad_torch_(x.clone(), t)  # both may overwrite their input
    buf = x.clone()
    loss, g = ce_grad_triton_(buf, t)
    assert g.data_ptr() == buf.data_ptr() and g.dtype == x.dtype  # in place, in the logits' dtype
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(g.float(), ref_g.float()) < tol
    assert torch.all(g[t == -100] == 0)


@pytest.mark.parametrize("V", [97, 4096, 5000], ids=["V<block", "V=block", "V>block"])
def test_interpreted_ce_kernel_matches_reference_fp32(interpret, V):
    _kernel_vs_reference(*_logits(12, V, torch.float32), 1e-6)


def test_interpreted_ce_kernel_matches_reference_bf16(interpret):
    _kernel_vs_reference(*_logits(9, 300, torch.bfloat16, seed=1), 2**-7)


def test_interpreted_ce_kernel_inside_the_head_loss(interpret):
    # The whole chunked head with the kernel against the reference path: fp32, the same 1e-6 as above.
    h, w, t = _case(seed=3)
    res = []
    for be in ("triton", "torch"):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(a, b, t, chunk_tokens=64, backends=Backends(per_op={"linear_ce": be}))
        loss.backward()
        res.append((loss.detach(), a.grad, b.grad))
    for x, y in zip(*res):
        assert rel_err(x, y) < 1e-6


def test_ce_kernel_without_triton_or_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from k3.ops.linear_ce import ce_grad_triton_

    with pytest.raises(RuntimeError, match="cross-entropy kernel cannot run"):
        ce_grad_triton_(*_logits(3, 10, torch.float32))


@pytest.mark.gpu
@needs_cuda
def test_ce_kernel_matches_reference_on_gpu_at_k3_mini_head_shapes():
    # One 8,192-row chunk of k3-mini's head (vocabulary 32,768), bf16 logits as autocast's GEMM gives them.
    x, t = _logits(8192, 32768, torch.bfloat16, device="cuda", seed=4)
    _kernel_vs_reference(x, t, 2**-7)


@pytest.mark.gpu
@needs_cuda
def test_head_loss_with_the_ce_kernel_matches_the_reference_on_gpu():
    # The head of k3-mini (hidden 1,024, vocabulary 32,768) on 16,384 rows in two chunks under bf16 autocast: loss to
    # 1e-5; d(h) and d(W) to 5e-3 of the largest entry (a gradient element may round to the neighbouring bf16 value
    # before the GEMMs, where the sums of exponentials differ in order).
    g = torch.Generator().manual_seed(5)
    h = torch.randn(16384, 1024, generator=g).cuda()
    w = (torch.randn(32768, 1024, generator=g) * 0.03).cuda()
    t = torch.randint(0, 32768, (16384,), generator=g).cuda()
    t[::9] = -100
    res = []
    for be in ("triton", "torch"):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(a, b, t, chunk_tokens=8192, backends=Backends(per_op={"linear_ce": be}))
        loss.backward()
        res.append((loss.detach(), a.grad, b.grad))
    assert rel_err(res[0][0], res[1][0]) < 1e-5
    for x, y in zip(res[0][1:], res[1][1:]):
        assert rel_err(x, y) < 5e-3
