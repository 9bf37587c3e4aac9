"""The grouped-GEMM MoE backend against the per-expert reference loop (CPU fp32, and GPU bf16 marked `gpu`)."""

import pytest
import torch

from helpers import rel_err
from k3.ops.moe import grouped_available, moe_experts, moe_experts_grouped, route
from k3.model.common import set_backends
from k3.ops.registry import Backends, Target, backends_from_env
from k3.ops.situ import situ_glu

pytestmark = pytest.mark.skipif(not grouped_available(Target(torch.device("cpu"), torch.float32))[0],
                                reason="this torch has no torch._grouped_mm")


def _problem(N, E, k, L, F, device="cpu", dtype=torch.float32, seed=0, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g)
    logits[:, : max(1, E // 8)] += skew  # concentrate load on a few experts (some get none)
    r = route(logits, None, k)
    z = torch.randn(N, L, generator=g)
    w1 = torch.randn(E, F, L, generator=g) * L ** -0.5
    w3 = torch.randn(E, F, L, generator=g) * L ** -0.5
    w2 = torch.randn(E, L, F, generator=g) * F ** -0.5
    leaves = [t.to(device, dtype).requires_grad_() for t in (z, w1, w3, w2)]
    weights = r.weights.to(device).requires_grad_()
    return leaves, weights, r.indices.to(device)


def _act(gate, up):
    return situ_glu(gate, up)


def _run(fn, leaves, weights, indices, act, seed=1):
    z, w1, w3, w2 = leaves
    u = fn(z, weights, indices, w1, w3, w2, act)
    dy = torch.randn(u.shape, generator=torch.Generator().manual_seed(seed)).to(u.device, u.dtype)
    grads = torch.autograd.grad((u.float() * dy.float()).sum(), [*leaves, weights])
    return u, grads


def _act13(h13):
    return situ_glu(*h13.chunk(2, dim=-1))


def _stacked(z, weights, indices, w1, w3, w2, act):
    """The grouped path with w1 and w3 stacked per expert (one GEMM for gate and up, as in training)."""
    return moe_experts_grouped(z, weights, indices, w1, w3, w2, act, w13=torch.cat([w1, w3], dim=1), act13=_act13)


@pytest.mark.parametrize("stacked", [False, True], ids=["gate-up-apart", "gate-up-stacked"])
@pytest.mark.parametrize("N,E,k,skew", [(1, 4, 2, 0.0), (37, 16, 4, 0.0), (200, 32, 8, 6.0)])
def test_grouped_matches_the_loop_forward_and_backward(N, E, k, skew, stacked):
    # fp32 on CPU: same products summed in another order, tolerance 1e-5 relative. Stacked, the gradients of w1
    # and w3 reach them through the stack.
    leaves, weights, idx = _problem(N, E, k, L=24, F=40, skew=skew)
    u_ref, g_ref = _run(moe_experts, leaves, weights, idx, _act)
    u, g = _run(_stacked if stacked else moe_experts_grouped, leaves, weights, idx, _act)
    assert rel_err(u, u_ref) < 1e-5
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-5


def test_grouped_checks_the_stacked_weight():
    leaves, weights, idx = _problem(8, 4, 2, L=8, F=8)
    z, w1, w3, w2 = leaves
    with pytest.raises(ValueError, match="w13 and act13 go together"):
        moe_experts_grouped(z, weights, idx, w1, w3, w2, _act, w13=torch.cat([w1, w3], 1))
    with pytest.raises(ValueError, match=r"w13 must have shape \[E, 2F, L\]"):
        moe_experts_grouped(z, weights, idx, w1, w3, w2, _act, w13=torch.cat([w1, w3], 2), act13=_act13)


def test_experts_without_tokens_get_zero_gradient():
    leaves, weights, idx = _problem(64, 16, 2, L=16, F=32, skew=50.0)
    used = set(idx.reshape(-1).tolist())
    assert len(used) < 16
    _, g = _run(moe_experts_grouped, leaves, weights, idx, _act)
    for e in set(range(16)) - used:
        assert g[1][e].abs().max() == 0 and g[3][e].abs().max() == 0


def test_grouped_rejects_bad_indices_by_name():
    leaves, weights, idx = _problem(8, 4, 2, L=8, F=8)
    with pytest.raises(ValueError, match="indices must lie in"):
        moe_experts_grouped(leaves[0], weights, idx + 4, *leaves[1:], _act)


def test_layer_backend_switch_gives_the_same_layer_output(tiny_cfg):
    from k3.model.latent_moe import LatentMoE

    layer = next(i for i in range(tiny_cfg.num_hidden_layers) if tiny_cfg.is_moe_layer(i))
    torch.manual_seed(0)
    moe = LatentMoE(tiny_cfg, layer)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 9, tiny_cfg.hidden_size)
    set_backends(moe, Backends(per_op={"moe": "torch"}))
    ref = moe(x)
    set_backends(moe, Backends(per_op={"moe": "grouped"}))
    assert rel_err(moe(x), ref) < 1e-5
    with pytest.raises(ValueError, match=r"per_op\['moe'\]='fast' is invalid: use auto, torch, grouped"):
        Backends(per_op={"moe": "fast"})
    with pytest.raises(ValueError, match="K3_MOE_BACKEND='fast' is invalid"):
        backends_from_env({"K3_MOE_BACKEND": "fast"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_bf16_on_gpu_matches_the_fp32_loop():
    # bf16 GEMMs with fp32 accumulation against the fp32 reference loop; the fused SiTU-GLU kernel runs
    # when Triton is available. Tolerance 2e-2 relative (bf16 rounding of inputs, h13 and the hidden).
    from k3.model.latent_moe import GroupedExperts

    E, k, L, F = 64, 8, 256, 512
    leaves, weights, idx = _problem(4096, E, k, L, F, device="cuda", skew=2.0)
    experts = GroupedExperts(E, L, F, 4.0, 25.0).cuda()
    u_ref, g_ref = _run(moe_experts, leaves, weights, idx, _act)
    bf = [t.detach().to(torch.bfloat16).requires_grad_() for t in leaves]
    wb = weights.detach().clone().requires_grad_()
    u, g = _run(moe_experts_grouped, bf, wb, idx, experts.act_fused)
    assert rel_err(u.float(), u_ref) < 2e-2
    for a, b in zip(g, g_ref):
        assert rel_err(a.float(), b) < 3e-2
    # gate and up as one GEMM against w1 and w3 stacked (the training path), the fused kernel on [gate | up]
    wb = weights.detach().clone().requires_grad_()

    def stacked(z, weights, indices, w1, w3, w2, act):
        return moe_experts_grouped(z, weights, indices, w1, w3, w2, act, w13=torch.cat([w1, w3], dim=1),
                                   act13=experts.act_fused13)

    u, g = _run(stacked, bf, wb, idx, experts.act_fused)
    assert rel_err(u.float(), u_ref) < 2e-2
    for a, b in zip(g, g_ref):
        assert rel_err(a.float(), b) < 3e-2


def test_whole_model_under_bf16_autocast_matches_the_loop(tiny_cfg):
    # The training setting (bf16 autocast, packed documents, MTP): loss equal to 1e-3 relative, all gradients
    # together within 3e-2 (L2) and every gradient tensor of >= 64 entries with cosine > 0.99 against the loop.
    from helpers import bf16_loss_and_grads, grad_disagreement, randomize_
    from k3.model.model import K3ForCausalLM

    model = randomize_(K3ForCausalLM(tiny_cfg)).train()
    ids = torch.randint(1, tiny_cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    seg = torch.zeros_like(ids)
    seg[0, 50:] = 1

    def run(backend):
        return bf16_loss_and_grads(model.set_backends(Backends(per_op={"moe": backend})), ids, seg)

    loss_ref, g_ref = run("torch")
    loss, g = run("grouped")
    assert rel_err(loss, loss_ref) < 1e-3
    global_err, cos = grad_disagreement(g, g_ref)
    assert global_err < 3e-2
    assert cos[0][0] > 0.99, cos[:4]
    # as the trainer runs it: weights cast once per step, w1 and w3 stacked into one grouped GEMM
    from k3.ops.weight_cast import WeightCasts

    with model.use_weight_casts(WeightCasts()):
        loss, g = run("grouped")
    assert rel_err(loss, loss_ref) < 1e-3
    global_err, cos = grad_disagreement(g, g_ref)
    assert global_err < 3e-2
    assert cos[0][0] > 0.99, cos[:4]
