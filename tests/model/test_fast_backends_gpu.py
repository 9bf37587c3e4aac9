"""Every fast backend inside k3-mini against the reference ops at the same sites (marked `gpu`)."""

import pytest
import torch

from helpers import InSituComparison, bf16_loss_and_grads, randomize_, rel_err
from k3.config import K3Config
from k3.model.attn_res import AttnResStream
from k3.model.common import RMSNorm, SituMLP
from k3.model.kda import KimiDeltaAttention
from k3.model.latent_moe import GroupedExperts
from k3.model.gated_mla import GatedMLA
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends, ops

FAST = {name: op.fast[0].name for name, op in ops().items() if op.fast}  # every fast implementation (ops with one)
REF = Backends(default="torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def mini():
    cfg = K3Config.from_preset("k3-mini").replace(vocab_size=4096)
    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(cfg)).cuda().train()  # non-zero AttnRes queries and router biases
    ids = torch.randint(1, cfg.vocab_size, (2, 1024), device="cuda")
    seg = torch.zeros_like(ids)
    seg[0, 300:] = 1
    seg[1, 700:] = 1
    return model, ids, seg


NEEDS = {"moe_combine": ["moe"]}  # the combine kernel runs inside the grouped MoE only
# The methods whose calls contain each op's backend choice (the model's ops: not the serving engine's paged decode
# nor the optimizer's update kernels, which have their own tests).
SITES = {"kda": [(KimiDeltaAttention, "forward")], "short_conv": [(KimiDeltaAttention, "forward")],
         "gate_norm": [(KimiDeltaAttention, "forward")],
         "mla": [(GatedMLA, "forward")], "moe": [(GroupedExperts, "forward")],
         "moe_combine": [(GroupedExperts, "forward")], "situ": [(GroupedExperts, "forward"), (SituMLP, "forward")],
         "attn_res": [(AttnResStream, "_mix")], "rms_norm": [(RMSNorm, "forward")]}
TRAINING_OPS = [op for op in FAST if op in SITES]


@pytest.mark.parametrize("fast_ops", [NEEDS.get(op, []) + [op] for op in TRAINING_OPS] + [TRAINING_OPS]
                         + [["kda", "short_conv", "host_offsets"]],
                         ids=[*TRAINING_OPS, "all", "kda_conv_host_offsets"])
def test_k3_mini_fast_backends_match_the_reference_at_every_site(mini, monkeypatch, fast_ops):
    # k3-mini shapes (KDA heads of 128, 192/128 MLA heads, 128 experts top-8), bf16 autocast, packed documents.
    # At every call of a site that holds one of `fast_ops` (a KDA layer, an MLA layer, the routed experts, a
    # SiTU-GLU FFN, an AttnRes mix), the call is repeated on copies of its real inputs with the reference ops and
    # with the fast ones (helpers.InSituComparison): outputs and the gradients of all inputs and parameters within
    # 5e-2 of the reference's largest entry, as in the op tests (bf16 on both sides here). The model itself runs on
    # the reference, so every site sees the reference model's inputs. A whole-model gradient comparison does not
    # work: this randomized k3-mini amplifies a 0.4% perturbation of one layer's output to ~80% eight layers on.
    # End to end, the loss with the fast ops must agree to 1e-2 relative. "host_offsets": the model also gets the
    # documents' offsets from the host, as the trainer gives them, with fla taking its chunk lists from there
    # (Backends.kda_host_offsets).
    from k3.model.model import packed_cu_seqlens

    model, ids, seg = mini
    cu = None
    host_offsets = "host_offsets" in fast_ops
    if host_offsets:
        fast_ops = [op for op in fast_ops if op != "host_offsets"]
        cu = packed_cu_seqlens(seg.cpu())
    # forced, whether validated or not; every other op on its reference
    fast = Backends(default="torch", per_op={op: FAST[op] for op in fast_ops}, kda_host_offsets=host_offsets)
    loss_ref, _ = bf16_loss_and_grads(model.set_backends(REF), ids, seg, cu_seqlens_cpu=cu)
    loss, _ = bf16_loss_and_grads(model.set_backends(fast), ids, seg, cu_seqlens_cpu=cu)
    assert rel_err(loss, loss_ref) < 1e-2, (float(loss), float(loss_ref))

    model.set_backends(REF)
    sites = sorted({s for op in fast_ops for s in SITES[op]}, key=lambda s: (s[0].__name__, s[1]))
    cmp = InSituComparison(fast, REF).patch(monkeypatch, sites)
    bf16_loss_and_grads(model, ids, seg, cu_seqlens_cpu=cu)
    called = {site for site, _ in cmp.records}
    assert called == {f"{c.__name__}.{n}" for c, n in sites}, called
    worst = cmp.worst()
    assert worst[0][0] < 5e-2, worst


def test_training_forward_and_backward_never_wait_for_the_device(mini):
    # With every fast backend and the documents' offsets given from the host (as the trainer gives them), a training
    # forward + backward of k3-mini never synchronizes the host with the device, so the host can queue the next
    # micro-batch while the device still runs the previous one. After one warm-up pass (compilation and
    # autotuning), torch's sync debug mode turns any synchronizing call into an error.
    from k3.model.batch import BatchInfo
    from k3.model.model import packed_cu_seqlens

    model, ids, seg = mini
    model.set_backends(Backends(per_op={op: FAST[op] for op in TRAINING_OPS}, kda_host_offsets=True))
    cu = packed_cu_seqlens(seg.cpu())

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            batch = BatchInfo.from_segment_ids(seg, cu_seqlens_cpu=cu)
            # with the statistics the trainer asks for (balancing's routing, QK-Clip's max logits)
            out = model(ids, labels=ids, batch=batch, return_logits=False, check_ids=False,
                        stats=("routing", "max_logit"))
            loss = out.loss + 0.3 * out.mtp_loss
        loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    model.zero_grad(set_to_none=True)
