"""MXFP4 QAT (report §4.1.4): the fake quantizers against encode-then-decode, straight-through gradients, what is and
is not quantized, and the MXFP4 export served by the engine against the QAT training forward.

Tolerances: the fake quantizers and the full-sequence forwards of the export are compared bit for bit (the same
roundings of the same values, the same kernels); the engine's prompt log-probabilities, computed over chunked
prefill with a paged cache, to 1e-4 absolute in fp32, as the engine's own tests hold them to a full forward
(accumulation order only; the MXFP8 rounding is per token, so it does not depend on how tokens are batched).
"""

import json
import os

import pytest
import torch
from safetensors import safe_open

from helpers import randomize_
from k3.checkpoint import from_pretrained, save_pretrained
from k3.config import K3Config
from k3.model.latent_moe import GroupedExperts, LatentMoE
from k3.model.model import K3ForCausalLM
from k3.model.mx_experts import MXExperts, expert_formats, quantize_experts
from k3.ops.moe import moe_experts
from k3.ops.mx import (mxfp4_dequantize, mxfp4_fake_quantize_any, mxfp4_quantize, mxfp8_fake_quantize_any)
from k3.train.qat import apply_qat, quantize_checkpoint, save_mxfp4

TOL_ENGINE = 1e-4


def _cfg():
    return K3Config.from_preset("tiny").replace(num_nextn_predict_layers=1, vocab_size=512, eos_token_id=0,
                                                pad_token_id=0)


def _model(seed=0):
    torch.manual_seed(seed)
    return randomize_(K3ForCausalLM(_cfg()), seed=seed)


def _values(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape[:-1] + (1,), generator=g).float())
    x[..., :4] = torch.tensor([0.25, 0.75, 2.5, 5.0])  # E2M1 midpoints (ties) against a block max of 6 below
    x[..., 4] = 6.0
    return x.to(dtype)


# --- the fake quantizers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_fake_quant_is_encode_then_decode_bit_for_bit(dtype):
    w = _values((3, 16, 96), 0, dtype)
    got = mxfp4_fake_quantize_any(w)
    want = mxfp4_dequantize(*mxfp4_quantize(w), dtype=dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    # and the experts' on-disk bytes decode to exactly the fake-quantized weight (what the export writes)
    for e in range(w.shape[0]):
        assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(w[e].float()), dtype=dtype), got[e])


def _e4m3_encode_decode(x):
    """MXFP8 built independently: per 32 the E8M0 scale 2^(floor(log2 amax) - 8), each value the nearest of the 253
    finite E4M3 values (ties to the even code), saturating at 448."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~codes.isnan()
    grid, code_ids = codes[finite], torch.arange(256)[finite]
    blocks = x.float().reshape(-1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 8, torch.full_like(amax, -127))
    v = (blocks / torch.exp2(exp)).clamp(-448, 448)
    d = (v[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    tie_even = torch.where(d == best, (code_ids % 2 == 0).float() * 2 + 1, torch.zeros_like(d))  # prefer even codes
    pick = grid[tie_even.argmax(-1)]
    return (pick * torch.exp2(exp)).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_fake_quant_is_encode_then_decode_bit_for_bit(dtype):
    x = _values((7, 64), 1, dtype) * 37.0
    x[0, 32:] = 0.0  # an all-zero block
    got = mxfp8_fake_quantize_any(x)
    assert torch.equal(got, _e4m3_encode_decode(x))


def test_gradients_pass_straight_through():
    w = _values((2, 8, 64), 2).requires_grad_()
    x = _values((5, 64), 3).requires_grad_()
    gw, gx = torch.randn(w.shape), torch.randn(x.shape)
    ((mxfp4_fake_quantize_any(w) * gw).sum() + (mxfp8_fake_quantize_any(x) * gx).sum()).backward()
    assert torch.equal(w.grad, gw) and torch.equal(x.grad, gx)


def test_qat_experts_are_the_experts_at_the_quantized_values_with_straight_through_gradients():
    """MXExperts(mxfp4 weights) on master weights P gives the forward and the gradients of the experts evaluated at
    the decoded weights Q = fq(P): d loss / dP = d loss / dQ."""
    torch.manual_seed(0)
    E, F, L, N, k = 4, 64, 32, 12, 2
    plain = GroupedExperts(E, L, F, 4.0, 25.0)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    z = torch.randn(N, L)
    logits = torch.randn(N, E)
    idx = logits.topk(k, -1).indices
    w = torch.softmax(logits.gather(1, idx), -1)
    from k3.ops.moe import Routing

    routing = Routing(w, idx, torch.sigmoid(logits), torch.zeros(N))
    qat = MXExperts(plain, "mxfp4", "mxfp8")
    assert qat.w1 is plain.w1 and qat.w2 is plain.w2
    out = qat(z, routing)
    out.square().sum().backward()

    q = {n: mxfp4_dequantize(*mxfp4_quantize(getattr(plain, n).detach()), dtype=torch.float32).requires_grad_()
         for n in ("w1", "w3", "w2")}
    fq8 = mxfp8_fake_quantize_any
    ref = moe_experts(fq8(z), w, idx, q["w1"], q["w3"], q["w2"], lambda g, u: fq8(plain.act(g, u)))
    ref.square().sum().backward()
    assert torch.equal(out, ref)
    for n in ("w1", "w3", "w2"):
        assert torch.equal(getattr(plain, n).grad, q[n].grad), n
    # the activations are rounded: without MXFP8 the output differs
    assert not torch.equal(MXExperts(plain, "mxfp4", None)(z, routing), out)


def test_apply_qat_wraps_only_the_routed_experts():
    model = _model()
    before = {n: (type(m), m) for n, m in model.named_modules()}
    params = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in params.items()}
    apply_qat(model, "mxfp4")
    after = dict(model.named_modules())
    assert after.keys() == before.keys()
    changed = sorted(n for n, m in after.items() if m is not before[n][1])
    moe = [n for n, m in after.items() if isinstance(m, LatentMoE)]
    assert changed == sorted(f"{n}.experts" for n in moe) and len(moe) == 5  # 4 backbone layers + the MTP layer
    assert all(isinstance(after[n], MXExperts) for n in changed)
    assert {n: p for n, p in model.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())  # the same tensors: optimizer, checkpoints
    ids = torch.randint(1, 512, (2, 40))
    model.train()
    out = model(ids, labels=ids)
    (out.loss + out.mtp_loss).backward()
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())  # QAT never rewrites the weights
    assert expert_formats(model) == ("mxfp4", "mxfp8")
    quantize_experts(model, None, None)
    assert all(type(m) is GroupedExperts for m in model.modules() if isinstance(m, GroupedExperts))


def test_nothing_but_the_experts_is_quantized():
    """With expert weights already exact in MXFP4 and the activations left alone, the QAT model's logits are the
    plain model's bit for bit: attention, latent projections, shared experts, router and head are untouched."""
    model = _model().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                for p in (m.w1, m.w3, m.w2):
                    p.copy_(mxfp4_fake_quantize_any(p))
    ids = torch.randint(1, 512, (2, 48))
    with torch.no_grad():
        plain = model(ids).logits
        quantize_experts(model, weights="mxfp4", activations=None)
        assert torch.equal(model(ids).logits, plain)
        quantize_experts(model, weights="mxfp4", activations="mxfp8")
        assert not torch.equal(model(ids).logits, plain)  # MXFP8 inputs do change the experts' outputs


# --- export, load, serve -----------------------------------------------------------------------------------------

def _exported(tmp_path):
    model = apply_qat(_model(seed=1), "mxfp4").eval()
    path = str(tmp_path / "mxfp4")
    save_mxfp4(model, path)
    return model, path


def test_export_writes_the_official_mxfp4_layout(tmp_path):
    model, path = _exported(tmp_path)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    names = set(index)
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight" in names
    cfg = json.load(open(os.path.join(path, "config.json")))
    q = cfg["text_config"]["quantization_config"] if "text_config" in cfg else cfg["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["input_activations"]["num_bits"] == 8
    shard = os.path.join(path, index["language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"])
    with safe_open(shard, "pt") as f:
        packed = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed")
        scale = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale")
    w2 = model.model.layers[1].block_sparse_moe.experts.w2[3].detach()
    L, F = w2.shape
    assert packed.dtype == torch.uint8 and packed.shape == (L, F // 2) and scale.shape == (L, F // 32)
    assert torch.equal(mxfp4_dequantize(packed, scale, torch.float32), mxfp4_fake_quantize_any(w2))


def test_loaded_export_computes_the_qat_training_forward(tmp_path):
    model, path = _exported(tmp_path)
    served = from_pretrained(path)
    assert expert_formats(served) == (None, "mxfp8")  # decoded weights as they are, MXFP8 expert inputs
    ids = torch.randint(1, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(served(ids).logits, model(ids).logits)
        # the same checkpoint read without the activation rounding gives other logits: the rounding is applied
        quantize_experts(served, None, None)
        assert not torch.equal(served(ids).logits, model(ids).logits)


def test_engine_on_the_export_gives_the_training_forward_logits(tmp_path):
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams
    from k3.serve.scheduler import SchedulerConfig

    model, path = _exported(tmp_path)
    eng = LLMEngine(from_pretrained(path), None, EngineConfig(
        cache_memory_mb=4.0, page_tokens=48, hash_block_tokens=16,
        scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=4, long_prompt_tokens=1000)))
    eng.eos_id = None
    prompt = torch.randint(1, 512, (110,), generator=torch.Generator().manual_seed(4)).tolist()
    seq = eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0))
    while eng.has_work():
        eng.step()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + seq.output_ids])).logits[0].float(), -1)
    got = torch.tensor([e["logprob"] for e in seq.prompt_logprobs[1:]])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max().item() <= TOL_ENGINE
    # greedy decoding follows the training forward's argmax
    for i, t in enumerate(seq.output_ids):
        assert t == int(ref[len(prompt) - 1 + i].argmax())


def test_ptq_is_the_qat_forward_of_the_unquantized_model(tmp_path):
    src = str(tmp_path / "src")
    model = _model(seed=2).eval()
    save_pretrained(model, src)
    out = quantize_checkpoint(src, str(tmp_path / "ptq"))
    ids = torch.randint(1, 512, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = apply_qat(model, "mxfp4")(ids).logits
        assert torch.equal(from_pretrained(out)(ids).logits, want)
    with pytest.raises(ValueError, match="source checkpoint"):
        quantize_checkpoint(src, src)


# --- MXFP4 experts served packed (k3.model.mx_experts.PackedMXExperts) -------------------------------------------

def test_packed_load_keeps_the_storage_and_computes_the_dequantized_model_bit_for_bit(tmp_path):
    from k3.model.mx_experts import PackedMXExperts

    _, path = _exported(tmp_path)
    dense = from_pretrained(path)
    packed = from_pretrained(path, packed_experts=True)
    ex = packed.model.layers[1].block_sparse_moe.experts
    assert isinstance(ex, PackedMXExperts) and expert_formats(packed) == ("mxfp4", "mxfp8")
    # the backbone's experts have no dense weights left (the MTP layer's stay dense: see from_pretrained)
    assert not any(".experts." in n for n, _ in packed.model.named_parameters())
    # the buffers are the file's bytes, a quarter of bf16 storage (plus one scale byte per 32)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_packed"
    with safe_open(os.path.join(path, index[name]), "pt") as f:
        assert torch.equal(ex.w3_packed[2], f.get_tensor(name))
    dense_ex = dense.model.layers[1].block_sparse_moe.experts
    dense_bytes = sum(getattr(dense_ex, w).numel() * 2 for w in ("w1", "w2", "w3"))  # as bf16
    packed_bytes = sum(b.numel() for b in ex.buffers())
    assert packed_bytes == dense_bytes // 4 + dense_bytes // 2 // 32
    ids = torch.randint(1, 512, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, dense(ids).logits)


def test_packed_model_saves_back_to_the_same_checkpoint(tmp_path):
    _, path = _exported(tmp_path)
    packed = from_pretrained(path, packed_experts=True)
    again = str(tmp_path / "again")
    save_pretrained(packed, again)
    ids = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(from_pretrained(again)(ids).logits, from_pretrained(path)(ids).logits)


def test_packed_experts_only_for_mxfp4_checkpoints(tmp_path):
    from k3.model.mx_experts import pack_experts

    src = str(tmp_path / "plain")
    save_pretrained(_model(seed=4).eval(), src)
    assert expert_formats(from_pretrained(src, packed_experts=True)) == (None, None)  # not MXFP4: loads dense
    with pytest.raises(ValueError, match="MXFP4 quantization_config"):
        save_pretrained(pack_experts(from_pretrained(src)), str(tmp_path / "bad"))


def test_engine_serves_packed_experts_as_the_training_forward(tmp_path):
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    model, path = _exported(tmp_path)
    served = from_pretrained(path, packed_experts=True)
    eng = LLMEngine(served, None, EngineConfig(cache_memory_mb=4.0, page_tokens=48, hash_block_tokens=16))
    eng.eos_id = None
    prompt = torch.randint(1, 512, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    seq = eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0))
    while eng.has_work():
        eng.step()
    with torch.no_grad():
        ref = model(torch.tensor([prompt + seq.output_ids])).logits[0]
    assert seq.output_ids == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(5)]


def test_serving_packs_the_experts_where_their_kernels_run(tmp_path, monkeypatch, capsys):
    from k3.data.tokenizer import byte_level_tokenizer
    from k3.ops import registry
    from k3.ops.registry import Backends
    from k3.serve.build import build_engine

    monkeypatch.setattr(registry, "_notices", set())  # said once per process: whichever test loaded one before
    _, path = _exported(tmp_path)
    byte_level_tokenizer(512).save(os.path.join(path, "tokenizer.json"))
    eng, _, _ = build_engine(path, device="cpu")  # the reference on CPU: decoded at load, and said so
    assert expert_formats(eng.model) == (None, "mxfp8")
    assert "decoded at load" in capsys.readouterr().err
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels run (in Triton's interpreter) on CPU tensors
    eng, _, _ = build_engine(path, device="cpu", backends=Backends(per_op={"mx_moe": "triton"}))
    assert expert_formats(eng.model) == ("mxfp4", "mxfp8")
    with pytest.raises(ValueError, match="packed_experts"):
        from_pretrained(path, packed_experts="yes")


def test_the_mtp_layers_experts_are_exported_in_mxfp4_too(tmp_path):
    model, path = _exported(tmp_path)
    L = model.config.num_hidden_layers
    names = set(json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"])
    assert f"language_model.model.layers.{L}.block_sparse_moe.experts.0.w2.weight_packed" in names
    served = from_pretrained(path)
    for w in ("w1", "w2", "w3"):  # the draft serves the values QAT trained it with
        trained = getattr(model.mtp[0].block.block_sparse_moe.experts, w)
        assert torch.equal(getattr(served.mtp[0].block.block_sparse_moe.experts, w), mxfp4_fake_quantize_any(trained))


def test_checkpoints_with_the_mtp_experts_stacked_still_load(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _model(seed=5).eval()
    path = str(tmp_path / "old")
    save_pretrained(model, path)
    L = model.config.num_hidden_layers
    index_file = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_file))
    for shard in set(index["weight_map"].values()):  # rewrite the MTP experts as one stacked tensor per matrix
        f = os.path.join(path, shard)
        tensors = load_file(f)
        for w in ("w1", "w2", "w3"):
            prefix = f"language_model.model.layers.{L}.block_sparse_moe.experts."
            per = sorted((int(k[len(prefix):].split(".")[0]), k) for k in tensors
                         if k.startswith(prefix) and k.endswith(f".{w}.weight"))
            if per:
                tensors[prefix + w] = torch.stack([tensors.pop(k) for _, k in per])
                for _, k in per:
                    del index["weight_map"][k]
                index["weight_map"][prefix + w] = shard
        save_file(tensors, f)
    json.dump(index, open(index_file, "w"))
    loaded = from_pretrained(path, verify=False)
    ids = torch.randint(1, 512, (1, 30), generator=torch.Generator().manual_seed(7))
    for w in ("w1", "w2", "w3"):
        assert torch.equal(getattr(loaded.mtp[0].block.block_sparse_moe.experts, w),
                           getattr(model.mtp[0].block.block_sparse_moe.experts, w))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("backend,capturable", [("torch", False), ("triton", True), ("triton_grouped", True)])
def test_decode_graphs_of_packed_experts_follow_their_backend(tmp_path, monkeypatch, backend, capturable):
    """A decode step over packed MXFP4 experts can be captured when op mx_moe runs on either kernel (both size their
    grids without reading the expert counts back), not on the reference (which reads them back)."""
    from k3.ops.registry import Backends
    from k3.serve.cuda_graphs import decode_graphs_support

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels count as available on CPU tensors
    _, path = _exported(tmp_path)
    served = from_pretrained(path, packed_experts=True)
    served.set_backends(Backends(per_op={"mx_moe": backend, "mla_decode": "triton"}))  # past the MLA check
    ok, why = decode_graphs_support(served, need_cuda=False)
    assert ok == capturable and (capturable or "packed MXFP4 experts" in why), why
