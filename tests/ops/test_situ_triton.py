"""Fused SiTU-GLU Triton kernels (k3.ops.situ_triton) against the reference k3.ops.situ.situ_glu.

CPU tests run the kernels in Triton's interpreter: the module reads TRITON_INTERPRET at each call, so the
`interpret` fixture sets it in-process. GPU tests (marked `gpu`) run the compiled kernels.

Tolerances, elementwise against a float64 reference on the same (rounded) inputs: fp32 outputs rtol = atol =
1e-5; bf16/fp16 outputs half an ulp of output rounding (rtol 2^-8 / 2^-11) plus the fp32 allowance, except
that the interpreter converts fp32 -> bf16 by truncation (the compiled kernel rounds to nearest), so bf16
gets a whole ulp (2^-7) there.
"""

import importlib
import sys

import pytest
import torch

from k3.ops.situ import situ_glu
from k3.ops._triton import runnable as available
from k3.ops.situ_triton import situ_glu_fused, situ_glu_split

FP32_TOL = 1e-5
# Output rounding of the kernel's fp32 result: (compiled, interpreter) relative bound.
ROUNDING = {
    torch.float32: (0.0, 0.0),
    torch.float16: (2.0**-11, 2.0**-11),
    torch.bfloat16: (2.0**-8, 2.0**-7),
}
# Zero, tiny, both sides of the kernel's tanh series/exp switch (|x / beta| = 0.1: gate 0.4, up 2.5),
# saturated, and past the |x| <= 60 of the random values.
SPECIAL = torch.tensor([0.0, 1e-30, -1e-6, 0.39, 0.41, -0.4, 2.45, 2.55, -2.5, 20.0, 60.0, -60.0, 100.0, -100.0])

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_h13(shape, dtype, device="cpu", seed=0):
    """[..., 2F] with |x| up to 60; the SPECIAL values in the gate half of the first row and the up half of
    the second (so each meets random partners)."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, generator=g) * 20).clamp(-60, 60)
    rows = h.view(-1, shape[-1])
    F, k = shape[-1] // 2, min(len(SPECIAL), shape[-1] // 2)
    rows[0, :k] = SPECIAL[:k]
    rows[min(1, rows.shape[0] - 1), F:F + k] = SPECIAL[:k]
    return h.to(device, dtype)


def reference(gate, up, dy, beta1=4.0, beta2=25.0):
    """float64 output and input gradients of the reference op."""
    g, u = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    y = situ_glu(g, u, beta1, beta2)
    y.backward(dy.double())
    return y.detach(), g.grad, u.grad


def assert_matches(actual, expected, interpreted):
    """Elementwise: |actual - expected| <= atol + rtol |expected|, rtol from actual's dtype (see module doc)."""
    rtol = FP32_TOL + ROUNDING[actual.dtype][1 if interpreted else 0]
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=FP32_TOL)


def check_fused(h13, interpreted):
    h13 = h13.requires_grad_()
    y = situ_glu_fused(h13)
    F = h13.shape[-1] // 2
    assert y.shape == (*h13.shape[:-1], F) and y.dtype == h13.dtype
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, y.dtype)
    y.backward(dy)
    y_ref, dg_ref, du_ref = reference(h13[..., :F], h13[..., F:], dy)
    assert h13.grad.shape == h13.shape and h13.grad.dtype == h13.dtype
    assert_matches(y, y_ref, interpreted)
    assert_matches(h13.grad[..., :F], dg_ref, interpreted)
    assert_matches(h13.grad[..., F:], du_ref, interpreted)


# --- CPU: Triton interpreter ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 74), (2, 3, 74), (1, 2), (70, 2200)])
def test_fused_matches_reference(interpret, dtype, shape):
    # F = 37 and 1100 are not multiples of the block; 1100 spans two column blocks, 70 rows several row blocks.
    check_fused(make_h13(shape, dtype), interpreted=True)


def test_fused_strided_rows_and_expanded_grad(interpret):
    # h13 as a column slice of a wider buffer (row stride 80, not 2F) and dy from .sum() (stride 0, expanded).
    buf = make_h13((6, 80), torch.float32)
    h13 = buf[:, :74].requires_grad_()
    situ_glu_fused(h13).sum().backward()
    _, dg_ref, du_ref = reference(h13[:, :37], h13[:, 37:], torch.ones(6, 37))
    assert_matches(h13.grad, torch.cat([dg_ref, du_ref], 1), interpreted=True)


def test_fused_saves_only_h13_and_handles_empty(interpret):
    h13 = make_h13((4, 10), torch.float32).requires_grad_()
    y = situ_glu_fused(h13, 2.0, 3.0)
    node = y.grad_fn
    while type(node).__name__ != "_SituGLUFusedBackward":  # past the reshape views
        node = node.next_functions[0][0]
    assert len(node.saved_tensors) == 1 and node.saved_tensors[0].data_ptr() == h13.data_ptr()
    # Custom betas reach the kernel.
    dy = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    y.backward(dy)
    y_ref, dg_ref, du_ref = reference(h13[:, :5], h13[:, 5:], dy, 2.0, 3.0)
    assert_matches(y, y_ref, True)
    assert_matches(h13.grad, torch.cat([dg_ref, du_ref], 1), True)

    empty = torch.zeros(0, 3, 8, requires_grad=True)
    out = situ_glu_fused(empty)
    assert out.shape == (0, 3, 4)
    out.sum().backward()
    assert empty.grad.shape == (0, 3, 8)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_split_matches_reference(interpret, dtypes):
    h = make_h13((3, 4, 74), torch.float32)
    gate = h[..., :37].to(dtypes[0]).requires_grad_()
    up = h[..., 37:].to(dtypes[1]).requires_grad_()
    y = situ_glu_split(gate, up)
    assert y.shape == gate.shape and y.dtype == gate.dtype
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype)
    y.backward(dy)
    y_ref, dg_ref, du_ref = reference(gate, up, dy)
    assert gate.grad.dtype == gate.dtype and up.grad.dtype == up.dtype
    assert_matches(y, y_ref, True)
    assert_matches(gate.grad, dg_ref, True)
    assert_matches(up.grad, du_ref, True)


def test_split_non_contiguous_and_one_grad(interpret):
    h = make_h13((37, 12), torch.float32)
    gate, up = h[:, :6].t(), h[:, 6:].t().requires_grad_()  # [6, 37], column stride 12
    y = situ_glu_split(gate, up, 3.0, 5.0)
    dy = torch.randn(6, 37, generator=torch.Generator().manual_seed(4))
    y.backward(dy)
    y_ref, _, du_ref = reference(gate, up, dy, 3.0, 5.0)
    assert_matches(y, y_ref, True)
    assert_matches(up.grad, du_ref, True)
    assert gate.grad is None


def test_validation(interpret):
    with pytest.raises(ValueError, match="even"):
        situ_glu_fused(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="h13 must be a floating"):
        situ_glu_fused(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="float64"):
        situ_glu_fused(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="scalar"):
        situ_glu_fused(torch.tensor(1.0))
    with pytest.raises(ValueError, match="beta1"):
        situ_glu_fused(torch.zeros(2, 8), beta1=0.0)
    with pytest.raises(ValueError, match="beta2"):
        situ_glu_split(torch.zeros(2, 4), torch.zeros(2, 4), beta2=-1.0)
    with pytest.raises(ValueError, match="same shape"):
        situ_glu_split(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="up must be a floating"):
        situ_glu_split(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))


def _launch_both(tune, shape=(300, 12), seed=0, device="cpu"):
    """Forward and backward through situ_triton._launch with or without the autotuner: (y, dg, du)."""
    from k3.ops import situ_triton

    h = make_h13(shape, torch.float32, device, seed)
    F = shape[-1] // 2
    g, u = h[:, :F], h[:, F:]
    y = torch.empty(shape[0], F, device=device)
    situ_triton._launch(g, u, 4.0, 25.0, y=y, tune=tune)
    dy = torch.randn(shape[0], F, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    dg, du = torch.empty_like(y), torch.empty_like(y)
    situ_triton._launch(g, u, 4.0, 25.0, dy=dy, dg=dg, du=du, tune=tune)
    return y, dg, du


def test_autotuned_launch_path_equals_the_fixed_one(interpret, monkeypatch):
    # The GPU launch path (triton.autotune over tile sizes, BLOCK_N derived by a heuristic) with one config, so
    # the interpreter can run it without timing anything; elementwise math: the same values whatever the tile.
    from k3.ops import situ_triton

    monkeypatch.setattr(situ_triton, "_TUNE_TILES", (2048,))
    monkeypatch.setattr(situ_triton, "_TUNE_WARPS", (4,))
    situ_triton._kernel.cache_clear()
    try:
        tuned = _launch_both(True)
    finally:
        situ_triton._kernel.cache_clear()
    for a, b in zip(tuned, _launch_both(False)):
        assert torch.equal(a, b)


def test_autotune_switch_is_validated():
    from k3.ops.registry import Backends, backends_from_env

    assert Backends().situ_autotune is True
    assert backends_from_env({"K3_SITU_AUTOTUNE": "0"}).situ_autotune is False
    with pytest.raises(ValueError, match="K3_SITU_AUTOTUNE"):
        backends_from_env({"K3_SITU_AUTOTUNE": "maybe"})
    with pytest.raises(ValueError, match="situ_autotune"):
        Backends(situ_autotune="maybe")


@pytest.mark.parametrize("backward", [False, True])
def test_compiled_kernel_takes_one_approximate_reciprocal(backward):
    # The CUDA build of the kernel (compiled here for sm_90 with Triton's bundled ptxas, no GPU needed) replaces
    # the IEEE division by PTX's rcp.approx.ftz.f32; the interpreter's build (APPROX_RCP off) keeps the division.
    # Its numerics on the device are checked by the GPU tests below.
    import importlib.util
    from pathlib import Path

    triton = pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location(
        "situ_sass", Path(__file__).resolve().parents[2] / "benchmarks" / "situ_sass.py")
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    try:
        fast = sass.compile_kernel(backward, 512, 4096, 8, 90, approx_rcp=True)
        exact = sass.compile_kernel(backward, 512, 4096, 8, 90, approx_rcp=False)
    except (RuntimeError, FileNotFoundError, triton.compiler.errors.CompilationError) as e:
        if "ptxas" in str(e) or "No such file" in str(e):
            pytest.skip(f"no CUDA toolchain bundled with triton here: {e}")
        raise
    assert fast.asm["ptx"].count("rcp.approx.ftz.f32") > 0
    assert "div.rn.f32" not in fast.asm["ptx"] and "div.full.f32" not in fast.asm["ptx"]
    assert "rcp.approx.ftz.f32" not in exact.asm["ptx"]
    assert "div.rn.f32" in exact.asm["ptx"] or "div.full.f32" in exact.asm["ptx"]


def test_available_without_triton_or_device(monkeypatch):
    # The module imports and reports (does not raise) without triton.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "k3.ops.situ_triton")
    fresh = importlib.import_module("k3.ops.situ_triton")
    ok, why = available()
    assert not ok and "triton is not importable" in why
    with pytest.raises(RuntimeError, match="triton is not importable"):
        fresh.situ_glu_fused(torch.zeros(2, 8))
    monkeypatch.undo()

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available() == (True, "")
    monkeypatch.delenv("TRITON_INTERPRET")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA tensors"):
            situ_glu_fused(torch.zeros(2, 8))
    else:
        ok, why = available()
        assert not ok and "TRITON_INTERPRET=1" in why
        with pytest.raises(RuntimeError, match="no CUDA device"):
            situ_glu_fused(torch.zeros(2, 8))


# --- GPU: compiled kernels --------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_realistic_shape():
    check_fused(make_h13((65536, 2048), torch.bfloat16, "cuda"), interpreted=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4096, 2000), (3, 333, 74)])
def test_gpu_fused_and_split(dtype, shape):
    check_fused(make_h13(shape, dtype, "cuda"), interpreted=False)
    h = make_h13(shape, dtype, "cuda", seed=5)
    F = shape[-1] // 2
    gate, up = h[..., :F].contiguous().requires_grad_(), h[..., F:].contiguous().requires_grad_()
    y = situ_glu_split(gate, up)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, dg_ref, du_ref = reference(gate, up, dy)
    for actual, expected in ((y, y_ref), (gate.grad, dg_ref), (up.grad, du_ref)):
        assert_matches(actual, expected, interpreted=False)


@pytest.mark.gpu
@needs_cuda
def test_gpu_autotuned_equals_fixed_config():
    # every tile size and warp count computes each element by the same instructions (1e-6 relative allowed)
    tuned, fixed = (_launch_both(t, (70000, 1536), device="cuda") for t in (True, False))
    for a, b in zip(tuned, fixed):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_offsets_past_2_31():
    # N * 2F > 2^31 elements: the rows past the int32 range must read and write the right places.
    F = 1024
    N = 2**31 // (2 * F) + 256
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GiB of free GPU memory")
    h13 = torch.randn(N, 2 * F, device="cuda", dtype=torch.bfloat16).mul_(20).requires_grad_()
    y = situ_glu_fused(h13)
    dy = torch.randn_like(y)
    y.backward(dy)
    for rows in (slice(0, 256), slice(N - 512, N)):
        h = h13.detach()[rows]
        y_ref, dg_ref, du_ref = reference(h[:, :F], h[:, F:], dy[rows])
        assert_matches(y[rows], y_ref, interpreted=False)
        assert_matches(h13.grad[rows, :F], dg_ref, interpreted=False)
        assert_matches(h13.grad[rows, F:], du_ref, interpreted=False)
