"""Serving-time stacked projections (k3.model.common.stack_projections): each layer's projections of one input as
one GEMM against their weights stacked in place. Same outputs as the layers one by one (fp32: 1e-5 of the largest
logit, the GEMM's blocking over more columns may sum in another order), fewer GEMMs, the same parameters by name and
value, no extra memory; a stack made stale by a replaced weight is noticed and not used."""

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import K3Config
from k3.model.common import stack_projections
from k3.model.model import K3ForCausalLM
from k3.ops import registry


class _GEMMs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "linear"):
            self.n[name] += 1
        return func(*args, **(kwargs or {}))


def _model():
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    return K3ForCausalLM(cfg).init_weights(seed=0).eval()


def _parts(model):
    """(KDA layers, MLA layers, MoE layers with shared experts, dense MLP layers)."""
    cfg = model.config
    moe = [m for m in model.modules() if type(m).__name__ == "LatentMoE" and m.shared_experts is not None]
    inside = {id(m.shared_experts) for m in moe}
    dense = [m for m in model.modules() if type(m).__name__ == "SituMLP" and id(m) not in inside]
    return len(cfg.kda_layers), len(cfg.full_attn_layers), len(moe), len(dense)


def _forward(model, ids):
    with torch.no_grad(), _GEMMs() as g:
        logits = model(ids).logits
    return logits, sum(g.n.values())


def test_stacked_projections_give_the_same_logits_with_fewer_gemms():
    model = _model()
    ids = torch.randint(1, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    want, gemms = _forward(model, ids)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    params_before = {"q": model.model.layers[model.config.kda_layers[0]].self_attn.q_proj.weight}
    groups = stack_projections(model)
    cfg = model.config
    n_kda, n_mla, n_moe, n_dense = _parts(model)
    assert groups == n_kda + n_mla + 2 * n_moe + n_dense  # an MoE layer: its projections and its experts
    got, stacked_gemms = _forward(model, ids)
    # KDA: q, k, v, decay, beta, gate in one; MLA: q_a, kv_a, gate in one; a dense MLP: gate and up in one; an MoE
    # layer: the latent down-projection and the shared experts' gate and up in one (on CUDA the router too)
    assert gemms - stacked_gemms == 5 * n_kda + 2 * n_mla + 2 * n_moe + n_dense
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    # the weights are views of one tensor per group, rows side by side, padded to a multiple of 16 rows
    kda = model.model.layers[cfg.kda_layers[0]].self_attn
    stack = kda.q_proj.serving_stack[0]
    assert kda.q_proj.weight.data_ptr() == stack.data_ptr() and stack.shape[0] % 16 == 0
    assert kda.k_proj.weight.data_ptr() == stack[kda.q_proj.out_features:].data_ptr()
    assert stack_projections(model) == groups  # again: nothing changes
    assert kda.q_proj.weight is params_before["q"]  # the same Parameter objects (an optimizer holds them)
    assert kda.q_proj.serving_stack[0] is stack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_gate_and_up_become_one_grouped_gemm(dtype):
    from k3.ops.moe import interleaved_halves
    from k3.ops.registry import Backends

    model = _model().set_dtype(dtype).set_backends(Backends(per_op={"moe": "grouped"}))
    ids = torch.randint(1, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))
    counts = []
    outs = []
    for stacked in (False, True):
        if stacked:
            stack_projections(model)
        with torch.no_grad(), _Grouped() as gr:
            outs.append(model(ids).logits.float())
        counts.append(gr.n)
    n_moe = _parts(model)[2]
    assert counts[0] - counts[1] == n_moe  # w1 and w3: one grouped GEMM instead of two, in every MoE layer
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[1] - outs[0]).abs().max() <= tol * outs[0].abs().max()
    ex = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    w13 = interleaved_halves(ex.w1, ex.w3)
    F = ex.w1.shape[1]
    assert w13 is not None and torch.equal(w13[:, :F], ex.w1) and torch.equal(w13[:, F:], ex.w3)
    assert ex.stack_halves(False) is False and ex.w1.is_contiguous() and interleaved_halves(ex.w1, ex.w3) is None


class _Grouped(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ == "_grouped_mm"
        return func(*args, **(kwargs or {}))


def test_a_stale_stack_is_noticed_and_not_used(monkeypatch, capsys):
    monkeypatch.setattr(registry, "_notices", set())
    model = _model()
    ids = torch.randint(1, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    stack_projections(model)
    kda = model.model.layers[model.config.kda_layers[0]].self_attn
    with torch.no_grad():
        kda.k_proj.weight = nn.Parameter(kda.k_proj.weight * 2)  # replaced: the stack still holds the old rows
    got, _ = _forward(model, ids)
    assert "a weight was replaced after stack_projections" in capsys.readouterr().err
    stack_projections(model, on=False)
    want, _ = _forward(model, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert not hasattr(kda.q_proj, "serving_stack")
    # each weight its own tensor again: k's rows no longer follow q's (fp32, 4 bytes an entry)
    assert kda.k_proj.weight.data_ptr() != kda.q_proj.weight.data_ptr() + 4 * kda.q_proj.weight.numel()


@pytest.mark.parametrize("on", [True, False])
def test_engine_decodes_the_same_tokens_stacked_or_not(on):
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    model = _model()
    prompts = [[3, 5, 7, 11, 13, 17], [2, 4, 6]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ref = LLMEngine(model, None, EngineConfig(cache_memory_mb=16, stack_projections=False))
    want = [s.output_ids for s in ref.generate(prompts, params)]
    eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=16, stack_projections=on))
    assert (getattr(model.model.layers[0].mlp.gate_proj, "serving_stack", None) is not None) == on
    assert [s.output_ids for s in eng.generate(prompts, params)] == want


def test_an_optimizer_made_before_stacking_still_trains_the_model():
    # an engine built on a model being trained (on-policy rollouts) stacks its projections; the optimizer's
    # parameters are still the model's, so its steps change what the next forward computes
    model = _model().train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    stack_projections(model)
    kda = model.model.layers[model.config.kda_layers[0]].self_attn
    stack = kda.q_proj.serving_stack[0]
    before = stack.clone()
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(stack, before)  # the step moved the stacked rows the engine's GEMM reads
    assert kda.q_proj.serving_stack[0] is stack and kda.q_proj.weight.data_ptr() == stack.data_ptr()


def test_training_after_stacking_gets_the_same_gradients():
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for stacked in (False, True):
        model = _model().train()
        if stacked:
            stack_projections(model)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6), n


def test_decode_ops_benchmark_counts_the_gemms_stacking_saves(capsys, monkeypatch):
    import json

    from helpers import load_benchmark

    mod = load_benchmark("decode_ops")
    monkeypatch.setattr(registry, "_ops", dict(registry._ops))  # the benchmark wraps the registered ops
    assert mod.main(["--preset", "tiny", "--device", "cpu"]) == 0
    off, on = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    n_kda, n_mla, n_moe, n_dense = _parts(_model())
    assert off["stack_projections"] is False and on["stack_projections"] is True
    assert off["gemms"] - on["gemms"] == 5 * n_kda + 2 * n_mla + 2 * n_moe + n_dense
    # and one add per MoE layer: the routed and shared outputs summed in the shared down-projection's GEMM
    assert off["operations"] - on["operations"] == off["gemms"] - on["gemms"] + n_moe


def _router_stack_on_cpu(monkeypatch):
    """The CUDA form of the MoE stack (router first, one GEMM with fp32 output) on CPU: the fp32-output GEMM as
    the fp32 GEMM of the same bf16 values (what aten mm.dtype computes, up to summation order)."""
    from k3.model import latent_moe

    monkeypatch.setattr(latent_moe, "fp32_out_gemm", lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(latent_moe, "mm_fp32_out", lambda a, b: a.float() @ b.float())


def test_the_router_joins_the_moe_stack_where_a_gemm_writes_fp32(monkeypatch):
    _router_stack_on_cpu(monkeypatch)
    model = _model().set_dtype(torch.bfloat16)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    moe = next(m for m in model.modules() if type(m).__name__ == "LatentMoE")
    x = torch.randn(24, model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        want_routing = moe.gate(x)
        want, _ = _forward(model, ids)
        stack_projections(model)
        assert moe.gate.serving_stack[0] is moe.routed_expert_down_proj.serving_stack[0]
        got_routing, z, sg, su = moe._stacked_projections(x)
        assert z.dtype == torch.bfloat16
        got, _ = _forward(model, ids)
    # the router's logits are the fp32 ones; the other outputs rounded as a bf16 GEMM rounds
    assert torch.equal(got_routing.indices, want_routing.indices)
    assert torch.allclose(got_routing.weights, want_routing.weights, rtol=1e-5, atol=1e-6)
    assert torch.allclose(z.float(), moe.routed_expert_down_proj(x).float(), rtol=1e-2, atol=1e-2)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_the_router_kernel_rounds_the_other_projections_of_the_moe_stack(monkeypatch):
    # op moe_route_round (in Triton's interpreter): the router's kernel also rounds the stack's other columns (no cast
    # kernel of its own); the same routing and hidden states as the router then the cast, once per MoE layer
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tests.helpers import count_fast_calls

    from k3.ops.registry import Backends

    _router_stack_on_cpu(monkeypatch)
    calls = count_fast_calls(monkeypatch, "moe_route_round", "moe_route")
    model = _model().set_dtype(torch.bfloat16)
    stack_projections(model)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    n_moe = _parts(model)[2]
    outs = []
    for per_op in ({"moe_route": "triton"}, {"moe_route": "triton", "moe_route_round": "triton"}):
        calls.clear()
        model.set_backends(Backends(default="torch", per_op=per_op))
        with torch.no_grad():
            outs.append(model(ids).logits.float())
        assert calls == [next(reversed(per_op))] * n_moe
    # the interpreter rounds by truncation, the cast to nearest: the rounded projections differ by at most one bf16
    # step, so the logits agree to bf16 noise
    assert (outs[1] - outs[0]).abs().max() <= 2e-2 * outs[0].abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stacked_projections_with_the_router_match_the_layers_one_by_one():
    model = _model().set_dtype(torch.bfloat16).cuda()
    ids = torch.randint(1, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(6)).cuda()
    moe = next(m for m in model.modules() if type(m).__name__ == "LatentMoE")
    x = torch.randn(24, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want_logits = torch.nn.functional.linear(x.float(), moe.gate.weight.float())
        want = model(ids).logits  # no GEMM counting here: a dispatch mode does not pass flex_attention through
        stack_projections(model)
        assert moe.gate.serving_stack[0] is moe.routed_expert_down_proj.serving_stack[0]  # the router in the GEMM
        routing, z, sg, su = moe._stacked_projections(x)
        got = model(ids).logits
    # the scores are the sigmoid of the logits: fp32 accumulation on both sides, another summation order, 1e-5 of the
    # largest logit (the sigmoid's slope is at most 1/4)
    assert (routing.scores - torch.sigmoid(want_logits)).abs().max() <= 1e-5 * want_logits.abs().max()
    assert torch.allclose(z.float(), moe.routed_expert_down_proj(x).float(), rtol=2e-2, atol=1e-2)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_decodes_the_same_stacked_or_not(dtype):
    # the decode path with its cache on the GPU kernels (fla's conv and KDA, the paged MLA kernel, grouped experts,
    # CUDA graphs where they apply) reading the stacked GEMMs' strided outputs: the same greedy tokens (fp32), and in
    # bf16 the same tokens for all but near-ties (the GEMMs sum in another order, ~1 bf16 step)
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    model = _model().set_dtype(dtype).cuda()
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = []
    for on in (False, True):
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=64, stack_projections=on))
        outs.append([s.output_ids for s in eng.generate(prompts, params)])
        del eng
    if dtype == torch.float32:
        assert outs[0] == outs[1]
    else:
        same = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y))
        assert same >= 0.9 * sum(len(x) for x in outs[0]), outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_experts_add_the_routed_output_in_their_down_gemm(dtype):
    # LatentMoE's serving path sums the routed output into the shared experts' down-projection (torch.addmm: one
    # GEMM, the sum rounded once); it equals down(h) + add up to that rounding (fp32: summation order, 1e-6 of the
    # largest; bf16: within one bf16 step of the largest, 2^-7), and with gradients it is that sum itself
    from k3.model.common import SituMLP

    g = torch.Generator().manual_seed(3)
    mlp = SituMLP(64, 96, 4.0, 25.0).to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    gate, up, add = (torch.randn(2, 5, n, generator=g).to(dtype) for n in (96, 96, 64))
    with torch.no_grad():
        plain = mlp.from_projections(gate, up) + add
        with _GEMMs() as ops:
            got = mlp.from_projections(gate, up, add=add)
    assert ops.n == {"addmm": 1}  # the down-projection with the sum, and no other GEMM
    assert got.shape == add.shape and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert (got.float() - plain.float()).abs().max() <= tol * plain.float().abs().max()
    trained = mlp.from_projections(gate, up, add=add)  # gradients on: the plain sum
    assert torch.equal(trained, mlp.from_projections(gate, up) + add) and trained.requires_grad
