"""KDA rollback by replay and MLA truncation: a verification leaves the committed state alone, the replay of the
accepted prefix equals feeding those tokens one at a time, and truncation returns the pages past the accepted
length."""

import torch

from k3.config import K3Config
from k3.model.cache import KDACache
from k3.model.kda import KimiDeltaAttention
from k3.ops.kda_replay import kda_replay
from k3.serve.cache.prefix import PrefixCache
from k3.serve.cache.views import KDAVerifyView

# fp32 throughout: the replay runs the same token recurrence as decoding, so they agree to fp32 rounding of a few
# dozen multiply-adds per state entry (observed ~1e-7; 1e-5 leaves room for another summation order).
TOL = 1e-5


def _layer():
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, layer_idx=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # decays and writes strong enough that a wrong replay length shows
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return layer.eval(), cfg


@torch.no_grad()
def test_replay_equals_feeding_the_accepted_tokens_one_at_a_time():
    layer, cfg = _layer()
    B, T, D = 3, 6, cfg.hidden_size
    g = torch.Generator().manual_seed(2)
    prefix = torch.randn(B, 7, D, generator=g)
    window = torch.randn(B, T, D, generator=g)  # the last token and T - 1 drafts
    committed = KDACache()
    layer(prefix, committed)  # the committed state and conv tails after 7 tokens
    state0, conv0 = committed.state.clone(), [c.clone() for c in committed.conv]

    view = KDAVerifyView(state0.clone(), torch.stack(conv0, 1))
    layer(window, view)
    assert torch.equal(view.state, state0)  # verification does not advance the committed state
    inp = view.inputs
    lengths = [1, 4, T]  # accepted drafts 0, 3 and all, plus the position before them
    state, conv = kda_replay(inp.q, inp.k, inp.v, inp.z, inp.beta_logits, torch.stack(inp.pre_conv, 2), layer.A_log,
                             layer.dt_bias, layer.lower_bound, state0, torch.stack(conv0, 1), lengths)
    for b, n in enumerate(lengths):
        ref = KDACache()
        ref.update(state0[b:b + 1].clone(), [c[b:b + 1].clone() for c in conv0])
        for t in range(n):
            layer(window[b:b + 1, t:t + 1], ref)
        scale = ref.state.abs().max()
        assert (state[b] - ref.state[0]).abs().max() <= TOL * scale, b
        ref_conv = torch.stack(ref.conv, 1)[0]
        assert (conv[b] - ref_conv).abs().max() <= TOL * ref_conv.abs().max(), b
    # a wrong length gives a different state: the test can tell
    assert (state[1] - state[2]).abs().max() > 1e-3 * state[2].abs().max()


@torch.no_grad()
def test_replay_in_two_pieces_equals_one():
    """The engine splits a replay at a hash-block boundary (to checkpoint the state there): same result."""
    layer, cfg = _layer()
    g = torch.Generator().manual_seed(3)
    committed = KDACache()
    layer(torch.randn(2, 5, cfg.hidden_size, generator=g), committed)
    state0, conv0 = committed.state, torch.stack(committed.conv, 1)
    view = KDAVerifyView(state0, conv0)
    layer(torch.randn(2, 5, cfg.hidden_size, generator=g), view)
    x = view.inputs
    pre = torch.stack(x.pre_conv, 2)
    args = (layer.A_log, layer.dt_bias, layer.lower_bound)
    whole = kda_replay(x.q, x.k, x.v, x.z, x.beta_logits, pre, *args, state0, conv0, [5, 4])
    s1, c1 = kda_replay(x.q, x.k, x.v, x.z, x.beta_logits, pre, *args, state0, conv0, [2, 1])
    sl = (slice(None), slice(2, 5))
    s2, c2 = kda_replay(x.q[sl], x.k[sl], x.v[sl], x.z[sl], x.beta_logits[sl], pre[sl], *args, s1, c1, [3, 3])
    sl1 = (slice(1, 2), slice(1, 4))
    s3, c3 = kda_replay(x.q[sl1], x.k[sl1], x.v[sl1], x.z[sl1], x.beta_logits[sl1], pre[sl1], *args, s1[1:], c1[1:],
                        [3])
    assert (s2[0] - whole[0][0]).abs().max() <= TOL * whole[0].abs().max()
    assert torch.equal(c2[0], whole[1][0])
    assert (s3[0] - whole[0][1]).abs().max() <= TOL * whole[0].abs().max()
    assert torch.equal(c3[0], whole[1][1])


def test_truncate_releases_the_pages_past_the_accepted_length():
    pc = PrefixCache(num_pages=40, num_mla_groups=2, num_kda_groups=1, page_tokens=8, hash_block_tokens=4)
    pc.admit("a", list(range(1, 12)))
    pc.ensure_capacity("a", 11)
    pc.register_tokens("a", list(range(1, 12)))  # 11 computed tokens: 2 pages per MLA group
    free = pc.stats()["free_pages"]
    pc.ensure_capacity("a", 11 + 1 + 7)  # a verification of 1 + 7 positions: up to 19 tokens, 3 pages per group
    assert pc.stats()["free_pages"] == free - 2
    tables = pc.block_tables("a")
    assert pc.truncate("a", 13) == 2  # 2 accepted: 13 tokens fit in 2 pages per group
    assert pc.stats()["free_pages"] == free
    assert pc.block_tables("a") == [t[:2] for t in tables]
    assert pc.truncate("a", 13) == 0  # nothing more to release
    pc.check_invariants()
    try:
        pc.truncate("a", 10)
    except ValueError as e:
        assert "registered" in str(e)
    else:
        raise AssertionError("truncating below the registered tokens must fail")
