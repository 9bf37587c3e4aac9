"""The ablation arms on a GPU (marked `gpu`), at k3-mini shapes: every fast backend at every site of each arm's
training forward against the reference ops (helpers.InSituComparison, as test_fast_backends_gpu), and the serving
engine's captured CUDA-graph decode steps against cache-free greedy generation."""

import pytest
import torch

from helpers import InSituComparison, bf16_loss_and_grads, randomize_, rel_err
from k3.config import K3Config, layer_lists
from k3.model.attn_res import AttnResStream
from k3.model.common import RMSNorm, SituMLP
from k3.model.gated_mla import GatedMLA
from k3.model.kda import KimiDeltaAttention
from k3.model.latent_moe import GroupedExperts
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends, ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAST = {name: op.fast[0].name for name, op in ops().items() if op.fast}
REF = Backends(default="torch")
L = 13  # k3-mini's layers


def _pattern(p: str) -> dict:
    kda, full = layer_lists(p)
    return {"kda_layers": kda, "full_attn_layers": full}


ARMS = {
    "all_mla": _pattern("M" * L), "all_kda": _pattern("K" * L), "rope": {"mla_use_nope": False},
    "ungated": {"mla_use_output_gate": False}, "plain": {"residual": "plain"}, "moe": {"moe_latent": False},
}


def _cfg(arm):
    return K3Config.from_preset("k3-mini").replace(vocab_size=4096, **ARMS[arm])


@pytest.mark.parametrize("arm", list(ARMS))
def test_arm_fast_backends_match_the_reference_at_every_site(arm, monkeypatch):
    # bf16 autocast, packed documents: each site's fast call within 5e-2 of the reference's largest entry (outputs
    # and gradients), the loss within 1e-2, the tolerances of test_fast_backends_gpu.
    cfg = _cfg(arm)
    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(cfg)).cuda().train()
    ids = torch.randint(1, cfg.vocab_size, (2, 512), device="cuda")
    seg = torch.zeros_like(ids)
    seg[0, 200:] = 1
    seg[1, 300:] = 1
    fast = Backends(default="torch", per_op={op: FAST[op] for op in FAST})
    loss_ref, _ = bf16_loss_and_grads(model.set_backends(REF), ids, seg)
    loss, _ = bf16_loss_and_grads(model.set_backends(fast), ids, seg)
    assert rel_err(loss, loss_ref) < 1e-2, (float(loss), float(loss_ref))
    sites = [(GroupedExperts, "forward"), (SituMLP, "forward"), (RMSNorm, "forward")]
    sites += [(KimiDeltaAttention, "forward")] if cfg.kda_layers else []
    sites += [(GatedMLA, "forward")] if cfg.full_attn_layers else []
    sites += [(AttnResStream, "_mix")] if cfg.residual == "attn_res" else []
    model.set_backends(REF)
    cmp = InSituComparison(fast, REF).patch(monkeypatch, sites)
    bf16_loss_and_grads(model, ids, seg)
    assert {site for site, _ in cmp.records} == {f"{c.__name__}.{n}" for c, n in sites}
    worst = cmp.worst()
    assert worst[0][0] < 5e-2, worst


@pytest.mark.parametrize("arm", list(ARMS))
@torch.no_grad()
def test_arm_serves_with_captured_decode_graphs(arm):
    # fp32 weights, wide logit gaps (lm_head x 40): greedy tokens of concurrent requests, a prefix-cache hit among
    # them, from captured decode steps (paged MLA decode kernel, grouped MoE) equal a full forward per token.
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams
    from k3.serve.scheduler import SchedulerConfig

    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(_cfg(arm).replace(num_nextn_predict_layers=0)), seed=3).cuda().eval()
    model.lm_head.weight.mul_(40)
    model.set_backends(Backends(per_op={"mla_decode": "triton", "moe": "grouped"}))
    g = torch.Generator().manual_seed(1)
    base = torch.randint(1, 4096, (300,), generator=g).tolist()
    prompts = [base[:130], base[:260], base[40:77]]
    want = []
    for p in prompts:
        ids = list(p)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        want.append(ids[len(p):])
    eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=256, page_tokens=64, hash_block_tokens=32,
                                              max_model_len=1024, cuda_graphs=True,
                                              scheduler=SchedulerConfig(max_num_seqs=4)))
    eng.eos_id = None
    assert eng.runner.graphs is not None and eng.runner.graphs.capture
    seqs = []
    for p in prompts:
        seqs.append(eng.add_request(list(p), SamplingParams(max_tokens=6, temperature=0)))
        eng.step()
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == want
    assert eng.runner.graphs.replays > 0
