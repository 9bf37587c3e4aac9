"""Statistics returned by the forward (k3.model.stats): routing of every LatentMoE layer, max logits of every
Gated MLA layer, only when asked."""

import pytest
import torch

from helpers import randomize_
from k3.model.latent_moe import LatentMoE
from k3.model.model import K3ForCausalLM
from k3.model.stats import STATS, check_stats
from k3.ops.moe import expert_load


def _model(cfg, seed=0):
    return randomize_(K3ForCausalLM(cfg.replace(num_nextn_predict_layers=1)), seed=seed).train()


def _batch(cfg, B=2, T=24, seed=0):
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    seg = torch.zeros_like(ids)
    seg[0, 10:] = 1
    return ids, seg


def test_routing_is_the_gates_decision_and_loads_sum_to_tokens_times_top_k(tiny_cfg):
    # What `last_routing` held: the gate's Routing of the layer's flattened input, detached.
    model = _model(tiny_cfg)
    ids, seg = _batch(tiny_cfg)
    inputs = {}
    moe = [m for m in model.modules() if isinstance(m, LatentMoE)]
    for m in moe:
        m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod.layer_idx, args[0].detach()))
    out = model(ids, labels=ids, segment_ids=seg, stats=("routing",))
    assert out.stats.asked == {"routing"} and out.stats.max_logit == {}
    assert out.stats.routing.keys() == {m.layer_idx for m in moe} == {1, 2, 3, 4, 5}  # 4 backbone + MTP
    loads = out.stats.expert_loads()
    B, T = ids.shape
    for m in moe:
        r = out.stats.routing[m.layer_idx]
        x = inputs[m.layer_idx]
        with torch.no_grad():
            want = m.gate(x.reshape(-1, x.shape[-1]))
        for got, ref in zip(r, want):
            assert not got.requires_grad and torch.equal(got, ref)
        tokens = B * (T - 1) if m.layer_idx == tiny_cfg.num_hidden_layers else B * T  # MTP sees T - 1 positions
        E, k = m.gate.weight.shape[0], m.gate.top_k
        assert r.indices.shape == (tokens, k)
        assert loads[m.layer_idx].dtype == torch.int64 and loads[m.layer_idx].shape == (E,)
        assert int(loads[m.layer_idx].sum()) == tokens * k
        assert torch.equal(loads[m.layer_idx], expert_load(r.indices, E))


def test_statistics_only_when_asked(tiny_cfg):
    model = _model(tiny_cfg)
    ids, seg = _batch(tiny_cfg)
    assert model(ids, labels=ids, segment_ids=seg).stats is None
    out = model(ids, labels=ids, segment_ids=seg, stats=STATS)
    assert out.stats.asked == set(STATS)
    assert out.stats.max_logit.keys() == {3, 4, 5} and out.stats.routing.keys() == {1, 2, 3, 4, 5}
    hidden, found = model.model(ids, segment_ids=seg, stats=("max_logit",))  # the backbone alone
    assert found.max_logit.keys() == {3, 4} and found.routing == {}
    assert torch.equal(hidden, out.hidden_states)
    for i in (3, 4):
        assert torch.equal(found.max_logit[i], out.stats.max_logit[i])


def test_statistics_are_checked(tiny_cfg):
    assert check_stats(None) == frozenset() and check_stats("routing") == {"routing"}
    model = _model(tiny_cfg)
    ids, _ = _batch(tiny_cfg)
    with pytest.raises(ValueError, match=r"among \('routing', 'max_logit'\), got \['loads'\]"):
        model(ids, stats=("routing", "loads"))
    with pytest.raises(ValueError, match="without a cache"):
        model(ids, cache=model.new_cache(), stats=("routing",))
    with pytest.raises(ValueError, match="without a cache"):
        model.model.layers[3].self_attn(torch.zeros(1, 2, tiny_cfg.hidden_size), cache=object(),
                                        return_max_logit=True)
