"""The fused AttnRes site (op ``attn_res_norm``: the pending add, the depth mix and the norm after it in one kernel)
against its definition, the composition of the add, k3.ops.attn_res and the model's RMSNorm.

CPU tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` tests run it
compiled at k3-mini's and the release's widths. Tolerances, relative to the largest reference entry: fp32 1e-5 (the
softmax online, the sums in another order); bf16 one bf16 step of the output on a GPU (2^-7: the same fp32 values
rounded, up to those sums) and three in the interpreter, which rounds to bf16 by truncation (h, x_hat and y are each
rounded once). The new partial sum is the reference's add exactly on a GPU, within one bf16 step in the interpreter.
"""

import pytest
import torch

from helpers import rel_err
from k3.ops.attn_res_norm import MAX_SOURCES, attn_res_norm, attn_res_norm_triton

INTERP_BF16 = 3 * 2 ** -7


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(L, shape, dtype, add=True, norm=True, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    # sources of different scales, as the blocks of a stream are: the scores then favour some over others
    src = [(torch.randn(*shape, generator=g) * (1 + i)).to(device, dtype) for i in range(L)]
    w = torch.randn(shape[-1], generator=g).to(device)
    nw = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(device, dtype) if norm else None
    a = torch.randn(*shape, generator=g).to(device, dtype) if add else None
    return src, w, nw, a


def _compare(src, w, nw, a, tol, tol_last):
    y_ref, last_ref = attn_res_norm(src, w, 1e-5, nw, 1e-6, a)
    y, last = attn_res_norm_triton(src, w, 1e-5, nw, 1e-6, a)
    assert y.dtype == src[0].dtype and y.shape == src[0].shape and last.shape == src[0].shape
    if a is None:
        assert last is src[-1]  # nothing to add: the partial sum is the last source itself
    elif tol_last == 0:
        assert torch.equal(last, last_ref)
    else:  # the interpreter's truncated sum: one step of the sum's own entries, which may exceed the mix's (the
        # sources have other scales), so the output is compared with the reference's mix of this sum
        assert rel_err(last.float(), last_ref.float()) <= tol_last
        y_ref, _ = attn_res_norm(list(src[:-1]) + [last], w, 1e-5, nw, 1e-6, None)
    assert rel_err(y.float(), y_ref.float()) <= tol
    return y, last


@pytest.mark.parametrize("L", [1, 2, 5])
@pytest.mark.parametrize("add,norm", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["add+norm", "norm", "add", "mix-only"])
def test_interpreted_kernel_fp32(interpret, L, add, norm):
    _compare(*_inputs(L, (3, 4, 96), torch.float32, add, norm), 1e-5, 0)


@pytest.mark.parametrize("L", [1, 3, 9])
@pytest.mark.parametrize("add,norm", [(True, True), (False, True), (True, False)], ids=["add+norm", "norm", "add"])
def test_interpreted_kernel_bf16(interpret, L, add, norm):
    _compare(*_inputs(L, (2, 5, 200), torch.bfloat16, add, norm), INTERP_BF16, 2 ** -7)


def test_interpreted_kernel_fp32_activations_with_a_bf16_norm_weight(interpret):
    # the model's RMSNorm on fp32 activations with a weight of another dtype: the reference's branch with roundings
    src, w, nw, a = _inputs(3, (4, 64), torch.float32)
    _compare(src, w, nw.bfloat16(), a, 1e-5, 0)


def test_the_mix_is_the_attn_res_definition(interpret):
    # the mix alone (no add, no norm) against k3.ops.attn_res written out: softmax over depth of the normalized
    # sources' scores, the raw sources weighted; a source made to dominate the scores dominates the output
    src, w, _, _ = _inputs(4, (6, 32), torch.float32, add=False, norm=False)
    src[2] = w.expand(6, 32) * 50  # scores RMSNorm(w) . w, far above the others
    y, _ = attn_res_norm_triton(src, w, 1e-5)
    v = torch.stack(src)
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w).sum(-1)
    want = (torch.softmax(scores, 0)[..., None] * v).sum(0)
    assert rel_err(y, want) < 1e-5
    assert rel_err(y, src[2]) < 1e-3


def test_a_wrong_kernel_is_caught(interpret, monkeypatch):
    # the comparison fails on a kernel that drops the pending add from the mix (it writes the sum but mixes the
    # partial sum as it was): the check above is not vacuous
    import k3.ops.attn_res_norm as mod

    src, w, nw, a = _inputs(3, (4, 64), torch.float32)
    y_ref, _ = attn_res_norm(src, w, 1e-5, nw, 1e-6, a)
    y_wrong, _ = attn_res_norm(src, w, 1e-5, nw, 1e-6, None)
    y, _ = mod.attn_res_norm_triton(src, w, 1e-5, nw, 1e-6, a)
    assert rel_err(y, y_ref) <= 1e-5 < rel_err(y_wrong, y_ref)


def test_bad_inputs_are_named(interpret):
    src, w, nw, a = _inputs(2, (3, 32), torch.float32)
    with pytest.raises(ValueError, match=r"sources\[1\] must be a tensor of shape \(3, 32\)"):
        attn_res_norm_triton([src[0], src[1][:2]], w, 1e-5)
    with pytest.raises(ValueError, match=r"w must have shape \[32\]"):
        attn_res_norm_triton(src, w[:16], 1e-5)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[32\]"):
        attn_res_norm_triton(src, w, 1e-5, nw[:3])
    with pytest.raises(ValueError, match="add must have the sources' shape"):
        attn_res_norm_triton(src, w, 1e-5, nw, 1e-5, a.double())
    with pytest.raises(ValueError, match="non-empty list"):
        attn_res_norm(([]), w, 1e-5)
    with pytest.raises(ValueError, match=f"at most {MAX_SOURCES} sources"):
        attn_res_norm_triton([src[0]] * (MAX_SOURCES + 1), w, 1e-5)
    with pytest.raises(RuntimeError, match="no backward"):
        attn_res_norm_triton([s.requires_grad_() for s in src], w, 1e-5)


def test_the_kernel_refuses_to_run_without_cuda_or_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    src, w, _, _ = _inputs(2, (3, 32), torch.float32)
    with pytest.raises(RuntimeError, match="cannot run: no CUDA device"):
        attn_res_norm_triton(src, w, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("D", [1024, 7168], ids=["k3-mini", "release"])
@pytest.mark.parametrize("L", [1, 2, 10])
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_gpu_kernel_matches_the_definition(D, L, rows):
    # compiled: bf16 (as served) within one bf16 step, the new partial sum exactly the reference's add; fp32 within
    # 3e-5 (the norm's and the mix's sums over 7,168 features in another order: 1.4e-5 measured at 2048 x 10 sources)
    src, w, nw, a = _inputs(L, (rows, D), torch.bfloat16, device="cuda", seed=L)
    with torch.no_grad():
        _compare(src, w, nw, a, 2 ** -7, 0)
        _compare(src, w, nw, None, 2 ** -7, 0)
        _compare(src, w, None, a, 2 ** -7, 0)
        _compare(*_inputs(L, (rows, D), torch.float32, device="cuda", seed=L), 3e-5, 0)
