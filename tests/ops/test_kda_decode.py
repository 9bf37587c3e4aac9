"""The fused KDA decode step (k3.ops.kda_decode): the one-kernel update equals the composed ops on random inputs,
in place in strided rows as a cache pool holds them, and the composed op equals the layer's own read/update path.

Tolerances: fp32, output and state 1e-5 of their largest entries (the op's; sums in another order). bf16 inputs in
Triton's CPU interpreter: 1e-2, because the interpreter truncates to bf16 where the reference and the compiled kernel
round (one bf16 step in some entries; as the replay kernel's tests). Conv tails: bit for bit (they are copies of the
inputs)."""

import pytest
import torch

from k3.ops.kda_decode import (KDAStore, kda_decode_composed, kda_decode_decay_proj, kda_decode_decay_proj_triton,
                               kda_decode_triton)
from k3.ops.registry import Backends

TORCH = Backends(default="torch")


def _case(B=3, H=2, K=16, W=4, dtype=torch.float32, seed=0, device="cpu", R=7, pad=5):
    """Random inputs and a store of R strided rows (each row `pad` elements longer than a state), requests in a
    scattered order of rows."""
    g = torch.Generator().manual_seed(seed)
    P = H * K

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device)

    stacked = r(B, 3 * P + 7).to(dtype)  # q, k, v inputs as column slices of one projection output
    xq, xk, xv = stacked[:, :P], stacked[:, P:2 * P], stacked[:, 2 * P:3 * P]
    z, gate = r(B, P).to(dtype), r(B, P).to(dtype)
    beta_logits = r(B, H).to(dtype)
    conv_w = tuple(r(P, W, s=0.5).to(dtype) for _ in range(3))
    A_log, dt_bias, norm_w = r(H, s=0.5), r(P), r(K, s=0.5) + 1
    E = H * K * K + 3 * P * (W - 1)
    buf = r(R, E + pad)[:, :E + pad]
    rows = torch.randperm(R, generator=g)[:B].to(device)
    return (xq, xk, xv, z, beta_logits, gate, conv_w, A_log, dt_bias, -5.0, norm_w, 1e-5), buf, rows


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _both(args, buf, rows):
    want_buf, got_buf = buf.clone(), buf.clone()
    want = kda_decode_composed(*args, KDAStore(want_buf, rows), backends=TORCH)
    got = kda_decode_triton(*args, KDAStore(got_buf, rows))
    return want, got, want_buf, got_buf


@pytest.mark.parametrize("shape", [dict(), dict(B=1, H=3, K=12), dict(B=2, K=32, W=3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_composed_ops(interpret, shape, dtype):
    args, buf, rows = _case(**shape, dtype=dtype)
    want, got, want_buf, got_buf = _both(args, buf, rows)
    H, K = args[7].shape[0], args[10].shape[0]
    W = args[6][0].shape[1]
    S = H * K * K
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    ds = (got_buf[:, :S] - want_buf[:, :S]).abs().max()
    assert ds <= tol * want_buf[rows, :S].abs().max()
    assert torch.equal(got_buf[:, S:], want_buf[:, S:])  # conv tails, and every other row and the padding
    untouched = torch.ones(buf.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got_buf[untouched], buf[untouched])
    assert not torch.equal(got_buf[rows, :S], buf[rows, :S])  # the state did move
    del W


def test_strided_rows_are_read_through_their_stride(interpret):
    # the rows as a static decode step hands them: one column of its [B, KDA layers] page table, a strided view.
    # Read as if contiguous, request b > 0 would take another request's state (the engine's bucket-2 decode parted
    # from the reference that way)
    args, buf, rows = _case(B=3)
    table = torch.stack([rows, (rows + 1) % buf.shape[0]], 1)  # [B, 2]: this layer's pages and another layer's
    strided = table.t()[0]
    assert strided.stride(0) == 2 and torch.equal(strided, rows)
    want_buf, got_buf = buf.clone(), buf.clone()
    want = kda_decode_composed(*args, KDAStore(want_buf, rows), backends=TORCH)
    got = kda_decode_triton(*args, KDAStore(got_buf, strided))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got_buf - want_buf).abs().max() <= 1e-5 * want_buf.abs().max()


def test_repeated_steps_stay_together(interpret):
    """Eight tokens through both paths, each from its own store: the states stay within the tolerance."""
    args, buf, rows = _case(B=2, seed=3)
    a, b = buf.clone(), buf.clone()
    for t in range(8):
        step, _, _ = _case(B=2, seed=10 + t)
        step = step[:6] + args[6:]  # new token inputs, the same layer parameters
        want = kda_decode_composed(*step, KDAStore(a, rows), backends=TORCH)
        got = kda_decode_triton(*step, KDAStore(b, rows))
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_composed_op_equals_the_layers_read_update_path():
    """The composed op on a store equals the layer's cache path (KDACache: read, the ops, update) for one token."""
    from k3.config import K3Config
    from k3.model.cache import KDACache
    from k3.model.kda import KimiDeltaAttention

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, layer_idx=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
        B, D = 2, cfg.hidden_size
        cache = KDACache()
        layer(torch.randn(B, 5, D, generator=g), cache)  # a committed state after 5 tokens
        state, conv = cache.state.clone(), torch.stack(cache.conv, 1).clone()
        x = torch.randn(B, 1, D, generator=g)
        want = layer(x, cache)  # the read/update path
        H, K = layer.num_heads, layer.head_dim
        buf = torch.cat([state.reshape(B, -1), conv.reshape(B, -1)], 1)
        xq, xk, xv, f_a, beta_logits, gate = (layer.q_proj(x), layer.k_proj(x), layer.v_proj(x), layer.f_a_proj(x),
                                              layer.b_proj(x), layer.g_proj(x))
        z = layer.f_b_proj(f_a)
        conv_w = tuple(m.weight[:, 0] for m in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d))
        y = kda_decode_composed(xq[:, 0], xk[:, 0], xv[:, 0], z[:, 0], beta_logits[:, 0], gate[:, 0], conv_w,
                                layer.A_log, layer.dt_bias, layer.lower_bound, layer.o_norm.weight, layer.o_norm.eps,
                                KDAStore(buf, torch.arange(B)), backends=TORCH)
        got = layer.o_proj(y)[:, None]
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.equal(buf[:, :H * K * K].reshape(B, H, K, K), cache.state)
    assert torch.equal(buf[:, H * K * K:].reshape(conv.shape), torch.stack(cache.conv, 1))


def test_bad_inputs_are_named():
    args, buf, rows = _case()
    with pytest.raises(ValueError, match="xk must be"):
        kda_decode_composed(args[0], args[1][:, :-1], *args[2:], KDAStore(buf, rows), backends=TORCH)
    with pytest.raises(ValueError, match="store.rows"):
        kda_decode_composed(*args, KDAStore(buf, rows[:1]), backends=TORCH)
    with pytest.raises(ValueError, match="store.buf must be fp32"):
        kda_decode_composed(*args, KDAStore(buf.double(), rows), backends=TORCH)


def _decay_proj_case(dtype, rank=12, device="cpu", **shape):
    """`_case` with the decay logits given as their low-rank input f_a [B, R] (a strided slice, as the layer's stacked
    projection gives it) and the up-projection [P, R]."""
    args, buf, rows = _case(dtype=dtype, device=device, **shape)
    B, P = args[0].shape
    g = torch.Generator().manual_seed(7)
    f_a = (torch.randn(B, rank + 3, generator=g)[:, :rank]).to(device, dtype)
    fb = (torch.randn(P, rank, generator=g) / rank ** 0.5).to(device, dtype)
    return args, f_a, fb, buf, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_the_decay_projection_equals_the_projection_then_the_kernel(interpret, dtype):
    # op kda_decode_decay_proj: the decode kernel computing the decay logits from f_a and the up-projection equals the
    # definition (F.linear, then the composed step) to kda_decode's tolerance, state and conv tails included
    args, f_a, fb, buf, rows = _decay_proj_case(dtype)
    rest = (args[4], args[5], *args[6:])
    want_buf, got_buf = buf.clone(), buf.clone()
    want = kda_decode_decay_proj(*args[:3], f_a, fb, *rest, KDAStore(want_buf, rows), backends=TORCH)
    got = kda_decode_decay_proj_triton(*args[:3], f_a, fb, *rest, KDAStore(got_buf, rows))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    S = args[7].shape[0] * args[10].shape[0] ** 2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    assert (got_buf[:, :S] - want_buf[:, :S]).abs().max() <= tol * want_buf[rows, :S].abs().max()
    assert torch.equal(got_buf[:, S:], want_buf[:, S:])
    # not vacuous: another up-projection moves the state
    other_buf = buf.clone()
    kda_decode_decay_proj_triton(*args[:3], f_a, fb.flip(0), *rest, KDAStore(other_buf, rows))
    assert (other_buf[:, :S] - want_buf[:, :S]).abs().max() > 1e-3 * want_buf[rows, :S].abs().max()
    with pytest.raises(ValueError, match=r"up-projection must be \[P=32, R=12\]"):
        kda_decode_decay_proj_triton(*args[:3], f_a, fb[:, :5], *rest, KDAStore(buf.clone(), rows))


def test_the_model_with_the_decay_projection_inside_decodes_the_same(interpret, monkeypatch):
    # the engine with kda_decode_decay_proj (and kda_decode) on the kernel: the same greedy tokens as kda_decode's
    # kernel alone, log-probs within 1e-4, and the fused op ran at the decode steps
    from helpers import assert_same_greedy, count_fast_calls, tiny_engine_runs

    calls = count_fast_calls(monkeypatch, "kda_decode_decay_proj")
    arms = [Backends(default="torch", per_op={"kda_decode": "triton", **extra})
            for extra in ({}, {"kda_decode_decay_proj": "triton"})]

    def ran(backends):  # the fused op ran at the decode steps exactly when asked for
        assert bool(calls) == ("kda_decode_decay_proj" in backends.per_op)

    assert_same_greedy(tiny_engine_runs(arms, 6, after=ran), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_with_the_decay_projection_equals_the_definition(dtype):
    """k3-mini's layer shape (8 heads of 128, decay rank 128), 16 requests; state within 1e-4 of its largest entry in
    fp32, 1e-3 in bf16: the kernel sums each decay logit in another order than the GEMM before rounding it to bf16, so
    a logit can round the other way (one bf16 step), and its decay with it (an H100 measured 3.4e-4)."""
    args, f_a, fb, buf, rows = _decay_proj_case(dtype, rank=128, device="cuda", B=16, H=8, K=128, W=4, R=40)
    rest = (args[4], args[5], *args[6:])
    want_buf, got_buf = buf.clone(), buf.clone()
    with torch.no_grad():
        want = kda_decode_decay_proj(*args[:3], f_a, fb, *rest, KDAStore(want_buf, rows), backends=TORCH)
        got = kda_decode_decay_proj_triton(*args[:3], f_a, fb, *rest, KDAStore(got_buf, rows))
    S = 8 * 128 * 128
    out_tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (got.float() - want.float()).abs().max() <= out_tol * want.float().abs().max()
    state_tol = 1e-4 if dtype == torch.float32 else 1e-3
    assert (got_buf[:, :S] - want_buf[:, :S]).abs().max() <= state_tol * want_buf[rows, :S].abs().max()
    assert torch.equal(got_buf[:, S:], want_buf[:, S:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_equals_the_composed_ops(dtype):
    """k3-mini's layer shape (8 heads of 128, conv 4), 16 requests in scattered pool rows; compiled, bf16 rounds as
    the reference does, so both dtypes are held to 1e-5 of the largest entries (bf16 output: one bf16 step)."""
    args, buf, rows = _case(B=16, H=8, K=128, W=4, dtype=dtype, device="cuda", R=40)
    want, got, want_buf, got_buf = _both(args, buf, rows)
    S = 8 * 128 * 128
    out_tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (got.float() - want.float()).abs().max() <= out_tol * want.float().abs().max()
    assert (got_buf[:, :S] - want_buf[:, :S]).abs().max() <= 1e-5 * want_buf[rows, :S].abs().max()
    assert torch.equal(got_buf[:, S:], want_buf[:, S:])


def test_the_engine_decodes_the_same_on_the_fused_kernel(interpret, monkeypatch):
    """The serving engine with the kernel (in Triton's interpreter) for its decode steps: the same greedy tokens as
    the composed ops, log-probs within 1e-4; the pool's pages advance in place (no write-back of decode states)."""
    import dataclasses

    from helpers import assert_same_greedy, tiny_engine_runs
    from k3.ops import registry

    calls = {"triton": 0, "torch": 0}
    op = registry.ops()["kda_decode"]

    def counted(fn, name):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setitem(registry._ops, "kda_decode", dataclasses.replace(
        op, reference=counted(op.reference, "torch"),
        fast=tuple(dataclasses.replace(f, fn=counted(f.fn, f.name)) for f in op.fast)))

    def ran(backends):  # the decode steps ran on it
        assert calls["torch" if backends is TORCH else "triton"] > 0

    runs = tiny_engine_runs((TORCH, Backends(default="torch", per_op={"kda_decode": "triton"})), 10, after=ran)
    assert_same_greedy(runs, 1e-4)
