"""Tests for the KDA reference ops: gate, l2norm, short conv, recurrent and chunkwise KDA."""

import math

import pytest
import torch
import torch.nn.functional as F

import k3.ops.kda as kda_mod
from k3.ops.kda import kda_chunk, kda_gate, kda_recurrent, l2norm, short_conv


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_inputs(B, T, H, K, V, seed=0, with_state=True):
    """Realistic KDA inputs: unit-norm q/k, gated log-decay in (-5, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen))
    k = l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.randn(B, T, H, generator=gen).sigmoid()
    A_log = 0.5 * torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(torch.randn(B, T, H, K, generator=gen), A_log, dt_bias)
    h0 = torch.randn(B, H, K, V, generator=gen) if with_state else None
    return q, k, v, g, beta, h0


# ---------------------------------------------------------------------------------------------
# 1. chunkwise form == recurrence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,T,H,K,V,chunk,with_state",
    [
        (1, 37, 1, 16, 16, 16, False),  # T < 64, not a multiple of the chunk
        (2, 150, 3, 32, 48, 64, True),  # T not a multiple of 64, K != V
        (2, 128, 2, 16, 24, 16, True),  # whole chunks
        (1, 200, 2, 64, 32, 64, True),
        (2, 5, 2, 8, 12, 64, True),  # a single, mostly padded chunk
        (1, 1, 1, 8, 8, 16, True),
    ],
)
def test_chunk_matches_recurrent(B, T, H, K, V, chunk, with_state):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=T + chunk, with_state=with_state)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, chunk_size=chunk)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5


def test_custom_scale_and_chunk_size_invariance():
    q, k, v, g, beta, h0 = make_inputs(2, 90, 2, 16, 16, seed=7)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=0.3, initial_state=h0)
    for chunk in (1, 8, 32, 128):
        o, s = kda_chunk(q, k, v, g, beta, scale=0.3, initial_state=h0, chunk_size=chunk)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# 2. split anywhere: carrying the state equals one pass
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [1, 30, 64, 100, 149])
def test_chunk_split_anywhere(split):
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 32, 24, seed=3)
    o_full, s_full = kda_chunk(q, k, v, g, beta, initial_state=h0)
    a = slice(0, split)
    b = slice(split, None)
    o1, s1 = kda_chunk(q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], initial_state=h0)
    o2, s2 = kda_chunk(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], initial_state=s1)
    assert rel_err(torch.cat([o1, o2], dim=1), o_full) < 1e-5
    assert rel_err(s2, s_full) < 1e-5


def test_prefill_then_decode():
    # Serving: chunked prefill of a prompt, then one recurrent step per generated token.
    q, k, v, g, beta, h0 = make_inputs(1, 80, 2, 16, 16, seed=4)
    o_full, s_full = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o, s = kda_chunk(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], initial_state=h0)
    outs = [o]
    for t in range(70, 80):
        step = slice(t, t + 1)
        o_t, s = kda_recurrent(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step],
                               initial_state=s)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), o_full) < 1e-5
    assert rel_err(s, s_full) < 1e-5


@pytest.mark.parametrize("cuts", [[5], [1, 2, 4], [2, 3, 11, 12], [19]])
def test_short_conv_split_anywhere(cuts):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 20, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    y_full, st_full = short_conv(x, w)
    ys, st = [], None
    for s, e in zip([0] + cuts, cuts + [20]):  # some segments are shorter than W-1 = 3
        y, st = short_conv(x[:, s:e], w, conv_state=st)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, dim=1), y_full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st, st_full)
    # The state is the last W-1 raw inputs, oldest first.
    torch.testing.assert_close(st_full, x[:, -3:].transpose(1, 2))


# ---------------------------------------------------------------------------------------------
# 3. packed sequences (cu_seqlens) == separate runs
# ---------------------------------------------------------------------------------------------


LENS = [7, 70, 33]


def _packed_inputs():
    T = sum(LENS)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 16, 24, seed=6)
    h0 = torch.randn(len(LENS), 2, 16, 24, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)), dtype=torch.long)
    return q, k, v, g, beta, h0, cu


@pytest.mark.parametrize("fn", [kda_chunk, kda_recurrent])
def test_cu_seqlens_kda(fn):
    q, k, v, g, beta, h0, cu = _packed_inputs()
    o, s = fn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert o.shape == v.shape and s.shape == h0.shape
    for i in range(len(LENS)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        o_i, s_i = fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                      initial_state=h0[i : i + 1])
        assert rel_err(o[:, sl], o_i) < 1e-6
        assert rel_err(s[i : i + 1], s_i) < 1e-6


def test_cu_seqlens_short_conv():
    gen = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 2, 12, 20])  # first sequence is shorter than W-1
    x = torch.randn(1, 20, 5, generator=gen)
    w = torch.randn(5, 4, generator=gen)
    st0 = torch.randn(3, 5, 3, generator=gen)
    y, st = short_conv(x, w, conv_state=st0, cu_seqlens=cu)
    assert st.shape == (3, 5, 3)
    for i in range(3):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        y_i, st_i = short_conv(x[:, sl], w, conv_state=st0[i : i + 1])
        torch.testing.assert_close(y[:, sl], y_i)
        torch.testing.assert_close(st[i : i + 1], st_i)


# ---------------------------------------------------------------------------------------------
# 4. gate
# ---------------------------------------------------------------------------------------------


def test_gate_range():
    H, K = 3, 8
    A_log = torch.tensor([-0.5, 0.0, 0.2])
    dt_bias = torch.zeros(H, K)
    # Strictly inside (lower_bound, 0) as long as fp32 can tell sigmoid apart from 0 and 1.
    z = torch.linspace(-12, 12, 97).view(-1, 1, 1).expand(-1, H, K)
    g = kda_gate(z, A_log, dt_bias)
    assert g.dtype == torch.float32 and g.shape == z.shape
    assert (g > -5.0).all() and (g < 0.0).all()
    # Far out, fp32 sigmoid saturates to exactly 0 or 1: g hits the bounds but never crosses.
    z = torch.tensor([-1e4, -200.0, 200.0, 1e4]).view(-1, 1, 1).expand(-1, H, K)
    g = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    assert torch.isfinite(g).all() and (g >= -5.0).all() and (g <= 0.0).all()
    g = kda_gate(z.bfloat16(), A_log, dt_bias, lower_bound=-3.0)
    assert g.dtype == torch.float32 and (g >= -3.0).all() and (g <= 0.0).all()


def test_gate_closed_form():
    A_log = torch.tensor([0.3, -1.2])
    dt_bias = torch.tensor([[0.1, -0.4], [2.0, 0.0]])
    z = torch.tensor([[[0.5, -1.0], [-3.0, 4.0]]])  # [1, H=2, K=2]
    g = kda_gate(z, A_log, dt_bias.flatten(), lower_bound=-5.0)
    for h in range(2):
        for c in range(2):
            x = math.exp(A_log[h].item()) * (z[0, h, c].item() + dt_bias[h, c].item())
            want = -5.0 / (1.0 + math.exp(-x))
            assert abs(g[0, h, c].item() - want) < 1e-6
    # dt_bias as [H, K] and [H * K] are the same thing.
    torch.testing.assert_close(kda_gate(z, A_log, dt_bias), g)


def test_gate_A_log_is_per_head():
    gen = torch.Generator().manual_seed(10)
    H, K = 4, 8
    z = torch.randn(2, 5, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g0 = kda_gate(z, A_log, dt_bias)
    A_log2 = A_log.clone()
    A_log2[2] += 1.0
    g1 = kda_gate(z, A_log2, dt_bias)
    changed = (g0 != g1).any(dim=(0, 1, 3))
    assert changed.tolist() == [False, False, True, False]


def test_gate_window_decay_stays_in_bf16_range():
    # With g > -5, 16 tokens decay by at most exp(-80) ~ 1.8e-35, still a normal bf16 number.
    _, _, _, g, _, _ = make_inputs(2, 256, 4, 32, 8, seed=11)
    windows = g.cumsum(1)
    window_sum = windows[:, 15:] - F.pad(windows, (0, 0, 0, 0, 1, 0))[:, : -16]
    torch.testing.assert_close(window_sum[:, 0], g[:, :16].sum(1))
    assert window_sum.min().item() > -80.0
    assert (window_sum.exp().bfloat16() > 0).all()
    # Even fully saturated gates cannot go below 16 * lower_bound.
    g_sat = kda_gate(torch.full((1, 16, 1, 4), 1e4), torch.zeros(1), torch.zeros(4))
    assert g_sat.sum(1).min().item() >= -80.0


# ---------------------------------------------------------------------------------------------
# 5. the recurrence itself, against an independent float64 loop
# ---------------------------------------------------------------------------------------------


def test_recurrence_equation_float64():
    T, K, V = 20, 8, 6
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, K, V, seed=12)
    S = h0[0, 0].double()
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[0, t, 0].double(), k[0, t, 0].double(), v[0, t, 0].double()
        b_t = beta[0, t, 0].double()
        alpha = torch.diag(g[0, t, 0].double().exp())
        S = (torch.eye(K, dtype=torch.float64) - b_t * torch.outer(k_t, k_t)) @ alpha @ S
        S = S + b_t * torch.outer(k_t, v_t)
        outs.append(S.T @ (q_t * K**-0.5))
    o_ref = torch.stack(outs).view(1, T, 1, V)
    for fn in (kda_recurrent, kda_chunk):
        o, s = fn(q, k, v, g, beta, initial_state=h0)
        assert rel_err(o, o_ref) < 1e-5
        assert rel_err(s[0, 0], S) < 1e-5


# ---------------------------------------------------------------------------------------------
# 6. short conv against conv1d
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", [True, False])
def test_short_conv_matches_conv1d(activation):
    gen = torch.Generator().manual_seed(13)
    B, T, C, W = 2, 17, 8, 4
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, 1, W, generator=gen)  # checkpoint shape
    ref = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w, groups=C).transpose(1, 2)
    if activation:
        ref = F.silu(ref)
    for weight in (w, w[:, 0]):
        y, st = short_conv(x, weight, activation=activation)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        assert st.shape == (B, C, W - 1) and st.dtype == torch.float32
    # Tap W-1 multiplies the current token, tap 0 the token W-1 steps back.
    x1 = torch.zeros(1, 6, 1)
    x1[0, 0, 0] = 1.0
    y1, _ = short_conv(x1, torch.tensor([[1.0, 2.0, 3.0, 4.0]]), activation=False)
    assert y1.flatten().tolist() == [4.0, 3.0, 2.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# 7. input validation
# ---------------------------------------------------------------------------------------------


def test_validation_errors():
    q, k, v, g, beta, h0 = make_inputs(2, 10, 2, 8, 4, seed=14)
    cu = torch.tensor([0, 4, 10])
    for fn in (kda_chunk, kda_recurrent):
        with pytest.raises(ValueError, match=r"^q has shape"):
            fn(q[0], k, v, g, beta)
        with pytest.raises(ValueError, match=r"^k has shape \(2, 10, 2, 7\)"):
            fn(q, k[..., :7], v, g, beta)
        with pytest.raises(ValueError, match=r"^v has shape"):
            fn(q, k, v[:, :9], g, beta)
        with pytest.raises(ValueError, match=r"^g has shape"):
            fn(q, k, v, g[:, :, :1], beta)
        with pytest.raises(ValueError, match=r"^beta has shape"):
            fn(q, k, v, g, beta[..., None])
        with pytest.raises(ValueError, match=r"^initial_state has shape \(2, 2, 4, 8\)"):
            fn(q, k, v, g, beta, initial_state=h0.transpose(-1, -2))
        with pytest.raises(ValueError, match="cu_seqlens requires batch size 1"):
            fn(q, k, v, g, beta, cu_seqlens=cu)
        with pytest.raises(ValueError, match="cu_seqlens must rise"):
            fn(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 4, 9]))
        with pytest.raises(ValueError, match=r"^initial_state has shape"):  # N = 2 sequences
            fn(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0[:1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk(q, k, v, g, beta, chunk_size=0)

    z = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"^A_log has shape"):
        kda_gate(z, torch.zeros(4, 8), torch.zeros(32))
    with pytest.raises(ValueError, match=r"^dt_bias has shape"):
        kda_gate(z, torch.zeros(4), torch.zeros(8))

    x = torch.randn(2, 5, 6)
    with pytest.raises(ValueError, match=r"^x has shape"):
        short_conv(x[0], torch.zeros(6, 4))
    with pytest.raises(ValueError, match=r"^weight has shape"):
        short_conv(x, torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"^conv_state has shape"):
        short_conv(x, torch.zeros(6, 4), conv_state=torch.zeros(2, 6, 4))


# ---------------------------------------------------------------------------------------------
# 8. bf16 inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [kda_chunk, kda_recurrent])
def test_bf16_inputs(fn):
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 32, 32, seed=15)
    o32, s32 = fn(q, k, v, g, beta, initial_state=h0)
    bf = torch.bfloat16
    o, s = fn(q.to(bf), k.to(bf), v.to(bf), g.to(bf), beta.to(bf), initial_state=h0)
    assert o.dtype == bf and s.dtype == torch.float32
    assert rel_err(o, o32) < 2e-2 and rel_err(s, s32) < 2e-2

    y, st = short_conv(v.flatten(2).to(bf), torch.randn(64, 4))
    assert y.dtype == bf and st.dtype == torch.float32


def test_l2norm():
    x = torch.randn(3, 5, 16) * 10
    y = l2norm(x)
    torch.testing.assert_close(y.norm(dim=-1), torch.ones(3, 5), rtol=1e-5, atol=1e-5)
    yb = l2norm(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# 9. intra-chunk pair scores: 16-token tiles == direct exact form; the fallback for g < -5
# ---------------------------------------------------------------------------------------------


def saturated_gates(B, T, H, K, seed, exact_bound=False):
    """Log-decays close to the lower bound -5 everywhere (a 64-chunk decays by ~exp(-320))."""
    gen = torch.Generator().manual_seed(seed)
    if exact_bound:
        return torch.full((B, T, H, K), -5.0)
    z = 6.0 + 0.5 * torch.randn(B, T, H, K, generator=gen)
    return kda_gate(z, torch.zeros(H), torch.zeros(H * K))  # in (-5, -4.5)


@pytest.mark.parametrize("gates", ["realistic", "saturated", "at_bound"])
@pytest.mark.parametrize("chunk", [64, 128, 40, 16, 8])
def test_tiled_pair_scores_match_direct(gates, chunk):
    B, T, H, K, V = 2, 300, 2, 32, 24
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=20 + chunk)
    if gates != "realistic":
        g = saturated_gates(B, T, H, K, seed=21, exact_bound=gates == "at_bound")
        assert g.min().item() >= -5.0 and g.max().item() <= -4.5
    assert kda_mod._tiles_are_exact(g)
    # the pair-score matrices themselves, on one block of chunks
    G = g[0, : 2 * chunk].transpose(0, 1).reshape(H, 2, chunk, K).cumsum(-2)
    qc = q[0, : 2 * chunk].transpose(0, 1).reshape(H, 2, chunk, K)
    kc = k[0, : 2 * chunk].transpose(0, 1).reshape(H, 2, chunk, K)
    if gates != "realistic":  # the decay over one chunk reaches about exp(-5 * chunk)
        assert G[..., -1, :].max().item() <= -4.5 * chunk
    tiled = kda_mod._pair_scores_tiled(qc, kc, G)
    direct = kda_mod._pair_scores_direct(qc, kc, G)
    for a, b in zip(tiled, direct):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < 1e-5
    assert (tiled[0].triu(1) == 0).all() and (tiled[1].triu() == 0).all()
    # the whole op, both ways
    o_t, s_t = kda_mod._kda_chunk(q, k, v, g, beta, None, h0, None, chunk, pairs="tiled")
    o_d, s_d = kda_mod._kda_chunk(q, k, v, g, beta, None, h0, None, chunk, pairs="direct")
    assert torch.isfinite(o_t).all() and torch.isfinite(s_t).all()
    assert rel_err(o_t, o_d) < 1e-5 and rel_err(s_t, s_d) < 1e-5
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o_t, o_r) < 1e-5 and rel_err(s_t, s_r) < 1e-5


def test_fallback_below_gate_bound(monkeypatch):
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 16, 24, seed=22)
    g_low = torch.where(torch.arange(16) % 3 == 0, 2.0 * g, g)  # some g down to -10
    assert g_low.min().item() < -5.0
    assert not kda_mod._tiles_are_exact(g_low)
    assert kda_mod._tiles_are_exact(torch.full((3,), -5.0))
    assert not kda_mod._tiles_are_exact(torch.full((3,), -5.001))

    def no_tiles(*args):
        raise AssertionError("the tiled pair scores need g >= -5")

    def no_direct(*args):
        raise AssertionError("the direct pair scores are only the fallback")

    # below the bound kda_chunk takes the exact direct form and still equals the recurrence
    with monkeypatch.context() as m:
        m.setattr(kda_mod, "_pair_scores_tiled", no_tiles)
        for chunk in (64, 16):
            o, s = kda_chunk(q, k, v, g_low, beta, initial_state=h0, chunk_size=chunk)
            o_ref, s_ref = kda_recurrent(q, k, v, g_low, beta, initial_state=h0)
            assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    # within the bound it takes the tiles
    with monkeypatch.context() as m:
        m.setattr(kda_mod, "_pair_scores_direct", no_direct)
        kda_chunk(q, k, v, g, beta, initial_state=h0)
        kda_chunk(q, k, v, torch.full_like(g, -5.0), beta, initial_state=h0)
    with pytest.raises(ValueError, match="pairs"):
        kda_mod._kda_chunk(q, k, v, g, beta, None, h0, None, 64, pairs="fast")


@pytest.mark.parametrize("gates", ["realistic", "saturated"])
def test_chunk_is_causal_bit_for_bit(gates):
    # The tiles' reference positions never lie after the row: changing later tokens leaves
    # every earlier output bit-for-bit unchanged (also inside a chunk and inside a tile).
    q, k, v, g, beta, h0 = make_inputs(1, 150, 2, 16, 24, seed=23)
    if gates == "saturated":
        g = saturated_gates(1, 150, 2, 16, seed=24)
    gen = torch.Generator().manual_seed(25)
    for cut in (1, 40, 60, 64, 100):
        later = [x.clone() for x in (q, k, v, g, beta)]
        for x in later:
            x[:, cut:] = torch.rand(x[:, cut:].shape, generator=gen) - 1.0  # g stays in (-1, 0)
        o1, _ = kda_chunk(q, k, v, g, beta, initial_state=h0)
        o2, _ = kda_chunk(*later, initial_state=h0)
        assert torch.equal(o1[:, :cut], o2[:, :cut])
        assert not torch.equal(o1[:, cut:], o2[:, cut:])


@pytest.mark.parametrize("C", [1, 2, 5, 16, 37, 64, 128])
def test_unit_lower_inverse(C):
    gen = torch.Generator().manual_seed(C)
    kk = l2norm(torch.randn(3, 2, C, 16, generator=gen))
    A = (kk @ kk.transpose(-1, -2)).tril(-1) * torch.rand(3, 2, C, 1, generator=gen)
    A[0, 0] = torch.ones(C, C).tril(-1)  # identical keys, beta = 1: alternating +-1 inverse
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double())
    assert rel_err(kda_mod._unit_lower_inverse(A), ref) < 1e-6


# ---------------------------------------------------------------------------------------------
# 10. gradients
# ---------------------------------------------------------------------------------------------


def _grads(fn, inputs, cu=None, chunk=None, seed=30):
    """Gradients of a fixed random linear function of (o, final state) w.r.t. every input."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = leaves
    kwargs = {} if chunk is None else {"chunk_size": chunk}
    if fn == "separate":  # reference: kda_recurrent on each packed sequence on its own
        outs, states = [], []
        for i in range(len(cu) - 1):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            o_i, s_i = kda_recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                     initial_state=h0[i : i + 1])
            outs.append(o_i)
            states.append(s_i)
        o, s = torch.cat(outs, dim=1), torch.cat(states)
    else:
        o, s = fn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("chunk,gates", [(64, "realistic"), (16, "realistic"), (64, "saturated"),
                                         (32, "below_bound")])
def test_chunk_gradients_match_recurrent(chunk, gates):
    inputs = list(make_inputs(2, 150, 2, 16, 24, seed=31))
    if gates == "saturated":
        inputs[3] = saturated_gates(2, 150, 2, 16, seed=32)
    elif gates == "below_bound":
        inputs[3] = inputs[3] * 1.6  # g in (-8, 0): the direct fallback
    ref = _grads(kda_recurrent, inputs)
    got = _grads(kda_chunk, inputs, chunk=chunk)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], got, ref):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 1e-4, name


def test_cu_seqlens_gradients():
    lens = [7, 70, 0, 1, 33, 64, 17]  # includes an empty sequence and whole-chunk ones
    T = sum(lens)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 16, 24, seed=33)
    h0 = torch.randn(len(lens), 2, 16, 24, generator=torch.Generator().manual_seed(34))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long)
    inputs = [q, k, v, g, beta, h0]
    ref = _grads("separate", inputs, cu=cu)
    for fn, chunk in ((kda_chunk, 64), (kda_chunk, 16), (kda_recurrent, None)):
        got = _grads(fn, inputs, cu=cu, chunk=chunk)
        for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], got, ref):
            assert rel_err(a, b) < 1e-4, (fn.__name__, chunk, name)
    # the empty sequence hands its initial state straight through
    for fn in (kda_chunk, kda_recurrent):
        _, s = fn(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
        assert torch.equal(s[2], h0[2])


@pytest.mark.parametrize("W", [4, 2, 1])
def test_cu_seqlens_short_conv_gradients(W):
    gen = torch.Generator().manual_seed(35)
    lens = [2, 10, 0, 1, 7]  # some shorter than W-1 = 3, one empty
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    x = torch.randn(1, sum(lens), 5, generator=gen, requires_grad=True)
    w = torch.randn(5, W, generator=gen, requires_grad=True)
    st0 = torch.randn(len(lens), 5, W - 1, generator=gen, requires_grad=True)
    wy = torch.randn(1, sum(lens), 5, generator=gen)
    ws = torch.randn(len(lens), 5, W - 1, generator=gen)
    y, st = short_conv(x, w, conv_state=st0, cu_seqlens=cu)
    ((y * wy).sum() + (st * ws).sum()).backward()
    got = [t.grad.clone() for t in (x, w, st0)]
    for t in (x, w, st0):
        t.grad = None
    loss = 0.0
    for i in range(len(lens)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        y_i, st_i = short_conv(x[:, sl], w, conv_state=st0[i : i + 1])
        torch.testing.assert_close(y[:, sl], y_i)
        torch.testing.assert_close(st[i : i + 1], st_i)
        loss = loss + (y_i * wy[:, sl]).sum() + (st_i * ws[i : i + 1]).sum()
    loss.backward()
    for a, t in zip(got, (x, w, st0)):
        torch.testing.assert_close(a, t.grad)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_kda_math_stays_fp32_under_autocast(fn):
    # Under bf16 autocast the reference's matmuls would silently drop to bf16 (the decay-parameter gradients then
    # drift by tens of percent); KDA's state math is fp32 by the spec, so autocast must change nothing at all.
    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 130, 2, 32
    q, k, v = (torch.randn(B, T, H, K, generator=g).to(torch.bfloat16) for _ in range(3))
    gate = kda_gate(torch.randn(B, T, H, K, generator=g), 0.5 * torch.randn(H, generator=g),
                    torch.randn(H * K, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    cu = torch.tensor([0, 50, T])
    op = kda_chunk if fn == "chunk" else kda_recurrent
    outs = []
    for enabled in (False, True):
        ins = [t.clone().requires_grad_() for t in (q, k, v, gate, beta)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            o, s = op(l2norm(ins[0]), l2norm(ins[1]), ins[2], ins[3], ins[4], cu_seqlens=cu)
        (o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        outs.append([o, s] + [t.grad for t in ins])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][1].dtype == torch.float32


def test_short_conv_ignores_autocast():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 20, 8, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 4, generator=g)
    ref = short_conv(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = short_conv(x, w)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
