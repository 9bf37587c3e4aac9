import math

import pytest
import torch
import torch.distributed as dist

from helpers import randomize_
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.ops.mla import max_logit
from k3.train.qk_clip import MaxLogitTracker, apply_qk_clip_, mla_layers, qk_clip_

TAU = 5.0


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(blow_up: bool = True):
    """Tiny model with MTP (three Gated MLA layers: 3, 4 and the MTP block's 5). With `blow_up`, head 0 of
    every MLA layer gets its query and key-nope rows scaled by 40 (logits ~1600x, far above TAU) while head 1
    stays small, and the shared extra key dims are enlarged so the query extra rows matter."""
    model = randomize_(K3ForCausalLM(K3Config.from_preset("tiny")), seed=0, scale=0.1)
    if blow_up:
        with torch.no_grad():
            for m in mla_layers(model):
                H, dn, dr, dv = m.num_heads, m.dn, m.dr, m.dv
                m.q_b_proj.weight.view(H, dn + dr, -1)[0] *= 40
                m.kv_b_proj.weight.view(H, dn + dv, -1)[0, :dn] *= 40
                m.kv_a_proj_with_mqa.weight[m.kv_rank:] *= 30
    return model


def _x(seed=0, shape=(2, 32)):
    return torch.randint(0, 4096, shape, generator=torch.Generator().manual_seed(seed))


def _forward(model, x, grad=False, tracker=None):
    """Each MLA layer's max logits from a forward's statistics, shown to `tracker` when one is given."""
    with torch.set_grad_enabled(grad):
        out = model(x, labels=x, stats=("max_logit",))  # labels: the MTP layer runs too
    if tracker is not None:
        tracker.observe(out.stats)
    return {i: t.clone() for i, t in out.stats.max_logit.items()}


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_clipped_heads_end_at_or_below_tau_and_others_untouched():
    model = _model()
    x = _x()
    tracker = MaxLogitTracker(model)
    before = _forward(model, x, tracker=tracker)
    assert set(before) == {3, 4, 5}
    over = {i: v > TAU for i, v in before.items()}
    assert all(bool(o[0]) and not bool(o[1]) for o in over.values()), before  # head 0 above, head 1 below
    w0 = _snapshot(model)

    info = qk_clip_(model, tracker, tau=TAU)
    assert info["clipped_heads"] == sum(int(o.sum()) for o in over.values()) == 3
    assert info["max_logit"] == max(float(v.max()) for v in before.values())
    assert info["per_layer"].keys() == before.keys()
    for i in before:
        assert torch.equal(info["per_layer"][i], before[i])

    after = _forward(model, x)
    for i, v in after.items():
        assert bool((v <= TAU * (1 + 1e-5)).all()), (i, v)
    for m in mla_layers(model):
        prefix = _prefix(model, m)
        H, dn, dr, dv = m.num_heads, m.dn, m.dr, m.dv
        q_new = m.q_b_proj.weight.detach().view(H, dn + dr, -1)
        kv_new = m.kv_b_proj.weight.detach().view(H, dn + dv, -1)
        q_old = w0[prefix + "q_b_proj.weight"].view(H, dn + dr, -1)
        kv_old = w0[prefix + "kv_b_proj.weight"].view(H, dn + dv, -1)
        for h in range(H):
            if not over[m.layer_idx][h]:
                assert torch.equal(q_new[h], q_old[h]) and torch.equal(kv_new[h], kv_old[h])
            else:
                assert not torch.equal(q_new[h], q_old[h])


def _prefix(model, module):
    return next(n for n, m in model.named_modules() if m is module) + "."


def test_shared_extra_key_dims_and_values_are_not_touched():
    model = _model()
    tracker = MaxLogitTracker(model)
    before = _forward(model, _x(), tracker=tracker)
    w0 = _snapshot(model)
    info = qk_clip_(model, tracker, tau=TAU)
    assert info["clipped_heads"] == 3
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), w0[n])}
    assert changed == {_prefix(model, m) + s for m in mla_layers(model) for s in ("q_b_proj.weight", "kv_b_proj.weight")}
    for m in mla_layers(model):
        p = _prefix(model, m)
        H, dn, dr, dv = m.num_heads, m.dn, m.dr, m.dv
        # The extra key dims (rows kv_lora_rank: of kv_a_proj_with_mqa) are shared by all heads: untouched.
        assert torch.equal(m.kv_a_proj_with_mqa.weight[m.kv_rank:], w0[p + "kv_a_proj_with_mqa.weight"][m.kv_rank:])
        kv_new = m.kv_b_proj.weight.detach().view(H, dn + dv, -1)
        kv_old = w0[p + "kv_b_proj.weight"].view(H, dn + dv, -1)
        q_new = m.q_b_proj.weight.detach().view(H, dn + dr, -1)
        q_old = w0[p + "q_b_proj.weight"].view(H, dn + dr, -1)
        assert torch.equal(kv_new[:, dn:], kv_old[:, dn:])  # value rows, every head
        gamma = TAU / float(before[m.layer_idx][0])
        torch.testing.assert_close(q_new[0, :dn], q_old[0, :dn] * math.sqrt(gamma), rtol=1e-6, atol=0)
        torch.testing.assert_close(q_new[0, dn:], q_old[0, dn:] * gamma, rtol=1e-6, atol=0)
        torch.testing.assert_close(kv_new[0, :dn], kv_old[0, :dn] * math.sqrt(gamma), rtol=1e-6, atol=0)


def test_clipped_logit_scales_exactly_to_tau():
    """Same layer inputs before and after: every logit of a clipped head scales by gamma, so its max is tau."""
    model = _model()
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod.layer_idx, args[0].detach()))
             for m in mla_layers(model)]
    tracker = MaxLogitTracker(model)
    before = _forward(model, _x(), tracker=tracker)
    for h in hooks:
        h.remove()
    qk_clip_(model, tracker, tau=TAU)
    for m in mla_layers(model):
        with torch.no_grad():
            _, new = m(inputs[m.layer_idx], return_max_logit=True)
        old = before[m.layer_idx]
        assert abs(float(new[0]) - TAU) <= 1e-4 * TAU, (m.layer_idx, float(new[0]))
        torch.testing.assert_close(new[1], old[1], rtol=1e-6, atol=0)
    # Without the extra-dim rows taking the full gamma the max would miss tau: the extra part is not negligible.
    m = mla_layers(model)[0]
    with torch.no_grad():
        c_kr = m.kv_a_proj_with_mqa(inputs[m.layer_idx])
        k_extra = c_kr[..., m.kv_rank:]
    assert float(k_extra.abs().max()) > 1.0


def test_no_op_when_all_heads_below_tau():
    model = _model(blow_up=False)
    tracker = MaxLogitTracker(model)
    before = _forward(model, _x(), tracker=tracker)
    w0 = _snapshot(model)
    info = qk_clip_(model, tracker)  # default tau = 100
    assert info["clipped_heads"] == 0
    assert info["max_logit"] == max(float(v.max()) for v in before.values()) < 100
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), w0[n]), n


def test_micro_batches_accumulate_and_eval_forwards_do_not():
    # The tracker sees what it is shown: the training forwards of the step, not an evaluation in between.
    model = _model(blow_up=False)
    tracker = MaxLogitTracker(model)
    r1 = _forward(model, _x(1), grad=True, tracker=tracker)
    r_eval = _forward(model, _x(9, shape=(4, 64)), grad=False)  # an evaluation between micro-batches
    r2 = _forward(model, _x(2), grad=True, tracker=tracker)
    want = {i: torch.maximum(r1[i], r2[i]) for i in r1}
    assert any(bool((r_eval[i] > want[i]).any()) for i in want)  # the eval record would have mattered
    assert any(not torch.equal(want[i], r2[i]) for i in want)  # and so does the first micro-batch
    info = qk_clip_(model, tracker, tau=1e9)
    for i in want:
        assert torch.equal(info["per_layer"][i], want[i]), i
    # Consumed: nothing recorded since, so the next call has nothing to work with.
    with pytest.warns(UserWarning, match="recorded"):
        again = qk_clip_(model, tracker, tau=1e9)
    assert again == {"max_logit": -math.inf, "clipped_heads": 0, "per_layer": {}}


def test_recording_off_records_nothing():
    # Statistics are outputs, asked for per forward: no hooks, no layer attributes, nothing without stats=.
    model = _model(blow_up=False)
    with torch.no_grad():
        out = model(_x(), labels=_x())
    assert out.stats is None
    assert all(len(m._forward_hooks) == 0 for m in mla_layers(model))
    assert not any(hasattr(m, a) for m in mla_layers(model) for a in ("last_max_logit", "record_max_logit"))
    with pytest.raises(ValueError, match="stats=\\('max_logit',\\)"):
        MaxLogitTracker(model).observe(out.stats)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_single_process_group_all_reduce(tmp_path):
    model = _model()
    tracker = MaxLogitTracker(model)
    before = _forward(model, _x(), tracker=tracker)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        info = qk_clip_(model, tracker, tau=TAU)
    finally:
        dist.destroy_process_group()
    assert info["clipped_heads"] == 3
    for i in before:
        assert torch.equal(info["per_layer"][i], before[i])


def test_consume_then_apply_is_qk_clip_and_reads_maxima_given_on_the_host():
    # The trainer consumes the maxima before the optimizer step, reads them back with the loss, and applies the
    # clip after the step from host values: the same weights and report as qk_clip_ in one call.
    x = _x(seed=3)
    a, b = _model(), _model()
    trackers = [MaxLogitTracker(m) for m in (a, b)]
    for m, t in zip((a, b), trackers):
        _forward(m, x, grad=True, tracker=t)
    info_a = qk_clip_(a, trackers[0], tau=TAU)
    maxima = trackers[1].consume()
    assert [tuple(t.shape) for t in maxima] == [(m.num_heads,) for m in mla_layers(b)]
    with pytest.warns(UserWarning, match="no Gated MLA layer recorded"):  # consumed: nothing left to read
        assert trackers[1].consume() == [None] * 3
    info_b = apply_qk_clip_(b, [t.clone() for t in maxima], tau=TAU)
    assert info_b["clipped_heads"] == info_a["clipped_heads"] == 3
    assert info_b["max_logit"] == info_a["max_logit"]
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="one entry per Gated MLA layer"):
        apply_qk_clip_(b, maxima[:1], tau=TAU)


def test_forward_statistics_equal_the_op_on_the_layers_q_and_k():
    # out.stats.max_logit of every MLA layer (backbone and MTP) is k3.ops.mla.max_logit of that layer's q and k.
    model = _model()
    x = _x(seed=4)
    seg = torch.zeros_like(x)
    seg[0, 11:] = 1
    seen = {}

    def spy(mod, args, kwargs, output):
        # the layer's q and k, rebuilt from its input as the layer builds them
        h = args[0]
        B, T, _ = h.shape
        H, dn, dr, dv = mod.num_heads, mod.dn, mod.dr, mod.dv
        q = mod.q_b_proj(mod.q_a_layernorm(mod.q_a_proj(h))).view(B, T, H, dn + dr)
        c, k_rope = mod.kv_a_proj_with_mqa(h).split([mod.kv_rank, dr], dim=-1)
        k_nope = mod.kv_b_proj(mod.kv_a_layernorm(c)).view(B, T, H, dn + dv)[..., :dn]
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(B, T, H, dr)], dim=-1)
        batch = kwargs.get("batch")
        seen[mod.layer_idx] = max_logit(q, k, mod.scale, None if batch is None else batch.segment_ids)

    for m in mla_layers(model):
        m.register_forward_hook(spy, with_kwargs=True)
    with torch.no_grad():
        out = model(x, labels=x, segment_ids=seg, stats=("max_logit",))
    assert out.stats.max_logit.keys() == seen.keys() == {3, 4, 5}
    assert out.stats.routing == {}  # only what was asked
    for i, t in out.stats.max_logit.items():
        assert t.shape == (2,) and t.dtype == torch.float32
        torch.testing.assert_close(t, seen[i], rtol=1e-6, atol=0)
    # the segment mask matters: without it (one document per row) some maximum differs
    with torch.no_grad():
        plain = model(x, labels=x, stats="max_logit").stats.max_logit
    assert any(not torch.equal(plain[i], out.stats.max_logit[i]) for i in plain)
