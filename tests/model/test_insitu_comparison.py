"""The in-situ backend comparison used by the GPU model tests (tests/helpers.py: InSituComparison), on CPU."""

import dataclasses

import pytest
import torch

from helpers import InSituComparison, randomize_
from k3.config import K3Config
from k3.model.attn_res import AttnResStream
from k3.model.latent_moe import GroupedExperts
from k3.model.model import K3ForCausalLM
from k3.ops import registry
from k3.ops.registry import Backends

REF = Backends(default="torch")
FAST_MOE = Backends(default="torch", per_op={"moe": "grouped"})


@pytest.fixture()
def tiny():
    cfg = K3Config.from_preset("tiny")
    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(cfg, backends=REF)).train()
    ids = torch.randint(1, cfg.vocab_size, (2, 96))
    seg = torch.zeros_like(ids)
    seg[0, 40:] = 1
    return model, ids, seg


def _loss(model, ids, seg):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, segment_ids=seg).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


SITES = [(GroupedExperts, "forward"), (AttnResStream, "_mix")]


def test_each_site_call_is_compared_and_the_model_runs_on_the_reference(tiny, monkeypatch):
    # fp32 on CPU: the grouped-GEMM MoE against the expert loop at every routed-expert call (same products summed
    # in another order, or the same: 1e-5 relative, as in the op test); the AttnRes site (no fast backend on CPU) compares the
    # reference with itself, exactly. The model's own loss and gradients are untouched by the comparison.
    model, ids, seg = tiny
    loss_ref, g_ref = _loss(model, ids, seg)
    cmp = InSituComparison(FAST_MOE).patch(monkeypatch, SITES)
    loss, g = _loss(model, ids, seg)
    assert torch.equal(loss, loss_ref) and all(torch.equal(g[n], g_ref[n]) for n in g_ref)
    sites = [s for s, _ in cmp.records]
    n_moe = sum(hasattr(layer, "block_sparse_moe") for layer in model.model.layers)
    assert sites.count("GroupedExperts.forward") >= n_moe > 0
    assert sites.count("AttnResStream._mix") > 0
    # every floating input and parameter was compared: z, the routing's 3 floating fields, w1, w3, w2
    moe_quantities = next(errs for s, errs in cmp.records if s == "GroupedExperts.forward")
    assert sorted(moe_quantities) == sorted(["output0", *(f"d_input{i}" for i in range(4)), "d_w1", "d_w3", "d_w2"])
    assert all(e == 0 for s, errs in cmp.records if s == "AttnResStream._mix" for e in errs.values())
    assert cmp.worst()[0][0] < 1e-5, cmp.worst()


def test_a_wrong_fast_path_is_caught_and_named(tiny, monkeypatch):
    # A "fast" MoE that is 10% off must show up at its site with an error of about 0.1.
    model, ids, seg = tiny
    # the registered fast implementation replaced (the registry hands it out: k3.ops.moe calls what dispatch gives)
    op = registry.ops()["moe"]
    grouped = op.fast[0].fn
    wrong = dataclasses.replace(op.fast[0], fn=lambda *a, **k: 1.1 * grouped(*a, **k))
    monkeypatch.setitem(registry._ops, "moe", dataclasses.replace(op, fast=(wrong,)))
    cmp = InSituComparison(FAST_MOE).patch(monkeypatch, SITES)
    _loss(model, ids, seg)
    err, site, _, _ = cmp.worst()[0]
    assert site == "GroupedExperts.forward" and 0.09 < err < 0.11, cmp.worst()
