"""The router kernel (k3.ops.moe_route.route_triton) against `route` (k3.ops.moe): the same experts in the same order
and weights, scores and cutoff within 1e-6 relative (the op's tolerance), on random logits (no ties), in Triton's CPU
interpreter; compiled on a GPU in the test marked gpu. And MoEGate takes it only without gradients."""

import pytest
import torch

from k3.ops.moe import route
from k3.ops.moe_route import route_any, route_round, route_round_any, route_round_triton, route_triton
from k3.ops.registry import Backends


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _check(logits, bias, k, renorm, scale):
    want = route(logits, bias, k, renorm, scale)
    got = route_triton(logits, bias, k, renorm, scale)
    assert torch.equal(got.indices, want.indices)
    for name in ("weights", "scores", "cutoff"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), name
        assert torch.equal(a[~fin], b[~fin]), name  # -inf cutoffs when k = E
        if fin.any():
            assert (a[fin] - b[fin]).abs().max() <= 1e-6 * b[fin].abs().max().clamp_min(1e-30), name


@pytest.mark.parametrize("N,E,k", [(1, 8, 2), (5, 128, 8), (3, 100, 4), (4, 8, 8)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_route(interpret, N, E, k, with_bias):
    g = torch.Generator().manual_seed(N * E + k)
    logits = torch.randn(N, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.1 if with_bias else None
    _check(logits, bias, k, True, 2.5)
    _check(logits, bias, k, False, 1.0)


def test_strided_logits_and_no_tokens(interpret):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 128 + 40, generator=g)
    _check(y[:, :128], torch.randn(128, generator=g), 8, True, 1.0)  # the router's columns of a stacked GEMM
    empty = route_triton(torch.zeros(0, 16), None, 2)
    assert empty.weights.shape == (0, 2) and empty.indices.shape == (0, 2)


def test_bad_inputs_are_named(interpret):
    with pytest.raises(ValueError, match="fp32"):
        route_triton(torch.zeros(2, 8, dtype=torch.bfloat16), None, 2)
    with pytest.raises(ValueError, match="power-of-two"):
        route_triton(torch.zeros(2, 8), None, 3)
    with pytest.raises(ValueError, match="bias"):
        route_triton(torch.zeros(2, 8), torch.zeros(7), 2)


def test_gradients_keep_the_differentiable_route(interpret):
    """With a logits tensor that needs gradients, route_any runs `route` (the kernel has no backward) whatever the
    backends say; without gradients it runs what they pick."""
    fast = Backends(default="torch", per_op={"moe_route": "triton"})
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    r = route_any(logits, None, 2, backends=fast)
    r.weights[:, 0].sum().backward()  # (all weights sum to 1 per token: their sum has no gradient)
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with torch.no_grad():
        r2 = route_any(logits, None, 2, backends=fast)
    assert torch.equal(r2.indices, r.indices)


def _check_round(y, E, bias, k, dtype):
    """route_round_triton against route_round: the routing as _check's; the rounded columns bit for bit compiled,
    and within one step of `dtype` in Triton's interpreter (it rounds by truncation)."""
    want_r, want_rest = route_round(y, E, bias, k, True, 2.5, dtype)
    got_r, got_rest = route_round_triton(y, E, bias, k, True, 2.5, dtype)
    assert torch.equal(got_r.indices, want_r.indices)
    for name in ("weights", "scores", "cutoff"):
        a, b = getattr(got_r, name), getattr(want_r, name)
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-6 * b.abs().max().clamp_min(1e-30), name
    assert got_rest.dtype == dtype and got_rest.shape == want_rest.shape
    if y.is_cuda:
        assert torch.equal(got_rest, want_rest)
    else:
        exact = y[:, E:]
        step = torch.finfo(dtype).eps * exact.abs() + (2.0 ** -24 if dtype == torch.float16 else 0.0)
        assert ((got_rest.float() - exact).abs() <= step).all()


@pytest.mark.parametrize("N,R", [(1, 40), (5, 2100), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_with_the_rounded_columns_equals_the_router_then_the_cast(interpret, N, R, dtype):
    # R = 2100: over two blocks of 1,024 columns and a part of a third
    g = torch.Generator().manual_seed(N + R)
    y = torch.randn(N, 128 + R, generator=g) * 3
    _check_round(y, 128, torch.randn(128, generator=g) * 0.1, 8, dtype)
    _check_round(torch.randn(N, 130 + R, generator=g)[:, 1:-1], 128, None, 4, dtype)  # a view with a row stride


def test_round_bad_inputs_are_named(interpret):
    with pytest.raises(ValueError, match="fp32"):
        route_round_triton(torch.zeros(2, 12, dtype=torch.bfloat16), 8, None, 2, True, 1.0, torch.bfloat16)
    with pytest.raises(ValueError, match="num_experts"):
        route_round_triton(torch.zeros(2, 8), 8, None, 2, True, 1.0, torch.bfloat16)
    with pytest.raises(ValueError, match="num_experts"):
        route_round_any(torch.zeros(2, 8), 0, None, 2, True, 1.0, torch.bfloat16)


def test_round_any_takes_the_kernel_only_where_picked(interpret, monkeypatch):
    from tests.helpers import count_fast_calls

    calls = count_fast_calls(monkeypatch, "moe_route_round")
    y = torch.randn(3, 20, generator=torch.Generator().manual_seed(1)).bfloat16().float()  # rounding leaves them
    on = Backends(default="torch", per_op={"moe_route_round": "triton"})
    off = Backends(default="torch", per_op={"moe_route": "triton"})
    (r1, rest1), (r2, rest2) = route_round_any(y, 8, None, 2, True, 1.0, torch.bfloat16, backends=on), \
        route_round_any(y, 8, None, 2, True, 1.0, torch.bfloat16, backends=off)
    assert calls == ["moe_route_round"]
    assert torch.equal(r1.indices, r2.indices) and torch.equal(rest1, rest2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_with_the_rounded_columns_equals_the_router_then_the_cast():
    # k3-mini's MoE stack: 128 router columns, then z (512) and the shared gate and up (1,536 each)
    g = torch.Generator().manual_seed(1)
    for N in (1, 16, 64, 4096):
        y = (torch.randn(N, 128 + 3584, generator=g) * 3).cuda()
        _check_round(y, 128, (torch.randn(128, generator=g) * 0.1).cuda(), 8, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_equals_route():
    g = torch.Generator().manual_seed(0)
    for N in (1, 16, 64, 4096):
        logits = (torch.randn(N, 128, generator=g) * 3).cuda()
        _check(logits, (torch.randn(128, generator=g) * 0.1).cuda(), 8, True, 2.5)


def test_the_engine_decodes_the_same_with_the_router_kernel(interpret):
    """The serving engine with the router kernel (in Triton's interpreter) in every MoE layer: the same greedy tokens
    as with `route`, log-probs within 1e-5."""
    from helpers import assert_same_greedy, tiny_engine_runs

    runs = tiny_engine_runs((Backends(default="torch"), Backends(default="torch", per_op={"moe_route": "triton"})), 8)
    assert_same_greedy(runs, 1e-5)
