"""Gated MLA core, NoPE (report §2.1.2): explicit and absorbed forms."""

import pytest
import torch

from k3.ops.mla import mla_absorbed, mla_attention, split_kv_b

DN, DR, DV, R = 128, 64, 128, 512  # K3 head dims and latent rank
SCALE = (DN + DR) ** -0.5


def reference_attention(q, k, v, scale, q_start, segment_ids=None):
    """Float64 softmax attention with explicit loops over batch, query and key."""
    B, Tq, H, _ = q.shape
    Tk = k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    starts = q_start.tolist() if isinstance(q_start, torch.Tensor) else [q_start] * B
    out = torch.zeros(B, Tq, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for i in range(Tq):
            pos = starts[b] + i
            keys = [
                j for j in range(Tk)
                if j <= pos and (segment_ids is None or segment_ids[b, j] == segment_ids[b, pos])
            ]
            s = torch.einsum("hd,jhd->hj", q[b, i], k[b, keys]) * scale
            p = torch.softmax(s, dim=-1)
            out[b, i] = torch.einsum("hj,jhd->hd", p, v[b, keys])
    return out


def rand(gen, *shape, std=1.0):
    return torch.randn(*shape, generator=gen) * std


def assert_close_fp32(actual, expected):
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- mla_attention


def test_full_causal_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 9, 3
    q, k, v = rand(g, B, T, H, DN + DR), rand(g, B, T, H, DN + DR), rand(g, B, T, H, DV)
    o = mla_attention(q, k, v, SCALE)
    assert o.shape == (B, T, H, DV) and o.dtype == torch.float32
    assert_close_fp32(o, reference_attention(q, k, v, SCALE, 0))


@pytest.mark.parametrize("q_start", [3, 8])
def test_chunked_prefill_queries_are_the_tail(q_start):
    g = torch.Generator().manual_seed(1)
    B, Tq, H = 2, 4, 2
    Tk = q_start + Tq
    q, k, v = rand(g, B, Tq, H, DN + DR), rand(g, B, Tk, H, DN + DR), rand(g, B, Tk, H, DV)
    o = mla_attention(q, k, v, SCALE, q_start=q_start)
    assert_close_fp32(o, reference_attention(q, k, v, SCALE, q_start))
    # Same as running the full sequence and keeping the tail rows.
    q_full = torch.cat([rand(g, B, q_start, H, DN + DR), q], dim=1)
    assert_close_fp32(o, mla_attention(q_full, k, v, SCALE)[:, q_start:])


def test_per_batch_q_start_tensor():
    g = torch.Generator().manual_seed(2)
    B, Tq, Tk, H = 3, 3, 10, 2
    q_start = torch.tensor([0, 4, 7])
    q, k, v = rand(g, B, Tq, H, 16), rand(g, B, Tk, H, 16), rand(g, B, Tk, H, 8)
    o = mla_attention(q, k, v, 0.25, q_start=q_start)
    assert_close_fp32(o, reference_attention(q, k, v, 0.25, q_start))
    for b in range(B):  # each row equals its own int-q_start call
        ob = mla_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], 0.25, q_start=int(q_start[b]))
        assert_close_fp32(o[b : b + 1], ob)


def test_segment_ids_block_cross_document_attention():
    g = torch.Generator().manual_seed(3)
    B, T, H = 2, 10, 2
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7]])
    q, k, v = rand(g, B, T, H, 24), rand(g, B, T, H, 24), rand(g, B, T, H, 8)
    o = mla_attention(q, k, v, 0.2, segment_ids=segment_ids)
    assert_close_fp32(o, reference_attention(q, k, v, 0.2, 0, segment_ids))

    # Perturb the keys/values of segment 1 (row 0) and 7 (row 1): other segments' outputs are unchanged.
    other = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    k2 = torch.where(other[..., None, None], k * 100 + 3, k)
    v2 = torch.where(other[..., None, None], v - 50, v)
    o2 = mla_attention(q, k2, v2, 0.2, segment_ids=segment_ids)
    assert torch.equal(o2[~other], o[~other])
    assert not torch.allclose(o2[other], o[other])

    # With a q_start: the query's segment is looked up at its absolute position.
    o_tail = mla_attention(q[:, 4:], k, v, 0.2, q_start=4, segment_ids=segment_ids)
    assert_close_fp32(o_tail, reference_attention(q[:, 4:], k, v, 0.2, 4, segment_ids))


def test_causality_future_keys_do_not_change_earlier_outputs():
    g = torch.Generator().manual_seed(4)
    B, T, H = 1, 8, 2
    q, k, v = rand(g, B, T, H, 32), rand(g, B, T, H, 32), rand(g, B, T, H, 16)
    o = mla_attention(q, k, v, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[:, 5:] = rand(g, B, 3, H, 32) * 10
    v2[:, 5:] = rand(g, B, 3, H, 16) * 10
    o2 = mla_attention(q, k2, v2, 0.2)
    assert torch.equal(o2[:, :5], o[:, :5])
    assert not torch.allclose(o2[:, 5:], o[:, 5:])


def test_bf16_returns_bf16():
    g = torch.Generator().manual_seed(5)
    q, k, v = rand(g, 1, 6, 2, 32), rand(g, 1, 6, 2, 32), rand(g, 1, 6, 2, 16)
    one_doc = torch.zeros(1, 6, dtype=torch.long)  # forces the masked path
    o = mla_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.2, segment_ids=one_doc)
    assert o.dtype == torch.bfloat16
    ref = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.2, 0)
    torch.testing.assert_close(o.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_mla_attention_validation():
    q, k, v = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 4)
    with pytest.raises(ValueError, match="k must have shape"):
        mla_attention(q, torch.zeros(1, 4, 3, 8), v, 1.0)
    with pytest.raises(ValueError, match="v must have shape"):
        mla_attention(q, k, torch.zeros(1, 5, 2, 4), 1.0)
    with pytest.raises(ValueError, match="q_start must be >= 0"):
        mla_attention(q, k, v, 1.0, q_start=-1)
    with pytest.raises(ValueError, match=r"q_start must have shape \[1\]"):
        mla_attention(q, k, v, 1.0, q_start=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        mla_attention(q, k, v, 1.0, segment_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="q_start \\+ Tq must be <= Tk"):
        mla_attention(q, k, v, 1.0, q_start=1, segment_ids=torch.zeros(1, 4, dtype=torch.long))


# ------------------------------------------------------------------- mla_absorbed


def make_latent_case(gen, B, Tq, L, H):
    q_nope = rand(gen, B, Tq, H, DN)
    q_rope = rand(gen, B, Tq, H, DR)
    c = rand(gen, B, L, R)
    k_rope = rand(gen, B, L, DR)
    kv_b = rand(gen, H * (DN + DV), R, std=R**-0.5)
    w_kc, w_vc = split_kv_b(kv_b, H, DN, DV)
    return q_nope, q_rope, c, k_rope, w_kc, w_vc


def explicit_form(q_nope, q_rope, c, k_rope, w_kc, w_vc, q_start):
    """Expand the latent to per-head keys/values and run mla_attention."""
    H = w_kc.shape[0]
    k_nope = torch.einsum("blr,hnr->blhn", c, w_kc)
    k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, H, -1)], dim=-1)
    v = torch.einsum("blr,hvr->blhv", c, w_vc)
    q = torch.cat([q_nope, q_rope], dim=-1)
    return mla_attention(q, k, v, SCALE, q_start=q_start)


@pytest.mark.parametrize("Tq", [1, 5])
def test_absorbed_equals_explicit(Tq):
    g = torch.Generator().manual_seed(6)
    B, L, H = 2, 12, 4
    case = make_latent_case(g, B, Tq, L, H)
    o = mla_absorbed(*case, SCALE)
    assert o.shape == (B, Tq, H, DV) and o.dtype == torch.float32
    assert_close_fp32(o, explicit_form(*case, q_start=L - Tq))
    # Explicit q_start (queries not at the cache tail): same answer as the explicit form.
    o = mla_absorbed(*case, SCALE, q_start=2)
    assert_close_fp32(o, explicit_form(*case, q_start=2))


@pytest.mark.parametrize("Tq", [1, 3])
def test_absorbed_per_batch_kv_len_ignores_padding(Tq):
    g = torch.Generator().manual_seed(7)
    B, L, H = 3, 11, 2
    q_nope, q_rope, c, k_rope, w_kc, w_vc = make_latent_case(g, B, Tq, L, H)
    kv_len = torch.tensor([11, 4, 7])
    o = mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, kv_len=kv_len)
    for b in range(B):
        n = int(kv_len[b])
        row = slice(b, b + 1)
        ob = explicit_form(q_nope[row], q_rope[row], c[row, :n], k_rope[row, :n], w_kc, w_vc, n - Tq)
        assert_close_fp32(o[b : b + 1], ob)

    # Garbage in the padding slots (huge, inf, NaN) changes nothing.
    pad = torch.arange(L)[None, :] >= kv_len[:, None]  # [B, L]
    c_bad = c.masked_fill(pad[..., None], 1e30)
    c_bad[1, -1] = float("nan")
    k_rope_bad = k_rope.masked_fill(pad[..., None], float("inf"))
    o_bad = mla_absorbed(q_nope, q_rope, c_bad, k_rope_bad, w_kc, w_vc, SCALE, kv_len=kv_len)
    assert torch.equal(o_bad, o)


def test_absorbed_per_batch_q_start_and_causality():
    g = torch.Generator().manual_seed(8)
    B, Tq, L, H = 2, 4, 10, 2
    q_nope, q_rope, c, k_rope, w_kc, w_vc = make_latent_case(g, B, Tq, L, H)
    q_start = torch.tensor([1, 6])
    o = mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, q_start=q_start)
    assert_close_fp32(o, explicit_form(q_nope, q_rope, c, k_rope, w_kc, w_vc, q_start))

    # Changing cache positions after a query's position leaves it unchanged.
    c2, k_rope2 = c.clone(), k_rope.clone()
    c2[:, 8:] += 5.0
    k_rope2[:, 8:] -= 5.0
    o2 = mla_absorbed(q_nope, q_rope, c2, k_rope2, w_kc, w_vc, SCALE, q_start=q_start)
    assert torch.equal(o2[0], o[0])  # positions 1..4 < 8
    assert torch.equal(o2[1, :2], o[1, :2])  # positions 6, 7
    assert not torch.allclose(o2[1, 2:], o[1, 2:])  # positions 8, 9 see the change


def test_absorbed_bf16_returns_bf16():
    g = torch.Generator().manual_seed(9)
    case = make_latent_case(g, 1, 2, 6, 2)
    o = mla_absorbed(*(t.bfloat16() for t in case), SCALE)
    assert o.dtype == torch.bfloat16
    ref = mla_absorbed(*(t.bfloat16().float() for t in case), SCALE)
    torch.testing.assert_close(o.float(), ref, rtol=1e-2, atol=1e-2)


def test_split_kv_b_layout():
    H, dn, dv, r = 3, 2, 4, 5
    weight = torch.arange(H * (dn + dv) * r, dtype=torch.float32).reshape(H * (dn + dv), r)
    w_kc, w_vc = split_kv_b(weight, H, dn, dv)
    assert w_kc.shape == (H, dn, r) and w_vc.shape == (H, dv, r)
    for h in range(H):
        rows = weight[h * (dn + dv) : (h + 1) * (dn + dv)]
        assert torch.equal(w_kc[h], rows[:dn])
        assert torch.equal(w_vc[h], rows[dn:])
    with pytest.raises(ValueError, match="kv_b_weight must have shape"):
        split_kv_b(weight[:-1], H, dn, dv)
    with pytest.raises(ValueError, match="num_heads"):
        split_kv_b(weight, 0, dn, dv)


def test_mla_absorbed_validation():
    g = torch.Generator().manual_seed(10)
    q_nope, q_rope, c, k_rope, w_kc, w_vc = make_latent_case(g, 2, 3, 6, 2)
    with pytest.raises(ValueError, match="kv_len must be in"):
        mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, kv_len=torch.tensor([6, 0]))
    with pytest.raises(ValueError, match="kv_len must be in"):
        mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, kv_len=7)
    with pytest.raises(ValueError, match="q_start must be >= 0"):
        mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, kv_len=torch.tensor([6, 2]))
    with pytest.raises(ValueError, match="w_kc must have shape"):
        mla_absorbed(q_nope, q_rope, c, k_rope, w_kc[:, :, :-1], w_vc, SCALE)
    with pytest.raises(ValueError, match="k_rope must have shape"):
        mla_absorbed(q_nope, q_rope, c, k_rope[:, :-1], w_kc, w_vc, SCALE)


def test_absorbed_takes_host_lists_like_tensors():
    # The serving runner passes per-row positions as Python lists: checked on the host (no device read-back),
    # same result as the tensor form; malformed lists and out-of-range values are named.
    g = torch.Generator().manual_seed(11)
    q_nope, q_rope, c, k_rope, w_kc, w_vc = make_latent_case(g, 2, 3, 10, 2)
    args = (q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE)
    o_t = mla_absorbed(*args, q_start=torch.tensor([2, 5]), kv_len=torch.tensor([5, 8]))
    o_l = mla_absorbed(*args, q_start=[2, 5], kv_len=[5, 8])
    assert torch.equal(o_t, o_l)
    assert torch.equal(mla_absorbed(*args, kv_len=[5, 8]), mla_absorbed(*args, kv_len=torch.tensor([5, 8])))
    with pytest.raises(ValueError, match="kv_len must hold 2 ints"):
        mla_absorbed(*args, kv_len=[5])
    with pytest.raises(ValueError, match="kv_len must be in"):
        mla_absorbed(*args, kv_len=[5, 11])
    with pytest.raises(ValueError, match="q_start must be >= 0"):
        mla_absorbed(*args, q_start=[2, -1], kv_len=[5, 8])
    with pytest.raises(ValueError, match="q_start must hold 2 ints"):
        mla_absorbed(*args, q_start=[2, True], kv_len=[5, 8])


def test_absorbed_query_blocks_give_the_same_result(monkeypatch):
    # Long contexts are attended in query blocks that bound the score memory: any block size gives the same
    # output (each softmax row is independent), with per-row lengths and starts too.
    import k3.ops.mla as mla_mod

    g = torch.Generator().manual_seed(12)
    q_nope, q_rope, c, k_rope, w_kc, w_vc = make_latent_case(g, 2, 9, 20, 2)
    kw = dict(q_start=[3, 11], kv_len=[12, 20])
    whole = mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, **kw)
    for rows in (1, 4):  # a budget of `rows` query rows of scores
        monkeypatch.setattr(mla_mod, "ABSORBED_SCORE_BYTES", rows * 2 * 2 * 20 * 4)
        blocked = mla_absorbed(q_nope, q_rope, c, k_rope, w_kc, w_vc, SCALE, **kw)
        torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
