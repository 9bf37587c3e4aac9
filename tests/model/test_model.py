import pytest
import torch

from helpers import randomize_, rel_err
from k3.model.model import K3ForCausalLM


def make(cfg, seed=0):
    return randomize_(K3ForCausalLM(cfg), seed=seed).eval()


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(tiny_cfg):
    torch.manual_seed(0)
    model = make(tiny_cfg)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 40))
    full = model(ids).logits
    cache = model.new_cache()
    parts = [model(ids[:, :17], cache=cache).logits]
    for t in range(17, 40):
        parts.append(model(ids[:, t:t + 1], cache=cache).logits)
    assert cache.seq_len == 40
    assert rel_err(torch.cat(parts, 1), full) < 1e-4


@torch.no_grad()
def test_chunked_prefill_equals_full_forward(tiny_cfg):
    model = make(tiny_cfg, seed=1)
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 150))
    full = model(ids).logits
    cache = model.new_cache()
    out = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 70), (70, 71), (71, 140), (140, 150)]]
    assert rel_err(torch.cat(out, 1), full) < 1e-4


@torch.no_grad()
def test_future_tokens_never_change_earlier_logits(tiny_cfg):
    model = make(tiny_cfg, seed=2)
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 90))
    ids2 = ids.clone()
    ids2[:, 60:] = torch.randint(0, tiny_cfg.vocab_size, (1, 30))
    a, b = model(ids).logits, model(ids2).logits
    # Equal up to fp32 rounding: the experts' GEMMs see other row counts when later tokens route elsewhere, and
    # some CPU BLAS kernels (AVX-512 builds) then block the reduction differently (measured 3e-7 on logits of
    # size ~1). A leak of the future would move these logits by O(0.1-1), as the last assertion shows.
    assert (a[:, :60] - b[:, :60]).abs().max() <= 1e-5
    assert not torch.allclose(a[:, 60:], b[:, 60:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_site_queries_taken_at_once_equal_each_site_computing_its_own(tiny_cfg, dtype, monkeypatch):
    # Forwards without gradients take every AttnRes site's query in one pass (K3Model._site_queries); with it
    # switched off each site computes its own. The same products bit for bit: the hidden states are equal, prefill
    # and decode.
    model = make(tiny_cfg, seed=4).to(dtype)
    qs = model.model._site_queries()
    layers = model.model.layers
    want = [q for layer in layers for q in layer.site_queries()]
    want.append(model.model.output_attn_res_norm.weight.float() * model.model.output_attn_res_proj.weight[0].float())
    assert len(qs) == 2 * len(layers) + 1 and all(a.dtype == torch.float32 and torch.equal(a, b)
                                                  for a, b in zip(qs, want))
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 12))
    outs = []
    for at_once in (True, False):
        if not at_once:
            monkeypatch.setattr(model.model, "_site_queries", lambda: None)
        cache = model.new_cache()
        outs.append([model.model(ids[:, :9], cache=cache)] + [model.model(ids[:, t:t + 1], cache=cache)
                                                               for t in range(9, 12)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    monkeypatch.undo()
    # the plain-residual ablation has no site queries; mixed dtypes fall back to each site's own
    assert make(tiny_cfg.replace(residual="plain")).model._site_queries() is None
    model.model.output_attn_res_norm.float()
    assert dtype == torch.float32 or model.model._site_queries() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mtp_layers_site_queries_at_once_equal_each_site_computing_its_own(tiny_cfg, dtype):
    # MTPLayer.site_queries: the block's two sites and the output site in one pass, bit for bit each site's own; a
    # forward without gradients takes them (or the ones its caller passes: a draft's chain computes them once), and
    # its output equals the forward with gradients, where each site computes its own
    from k3.model.attn_res import site_query

    tiny_cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    mtp = make(tiny_cfg, seed=5).to(dtype).mtp[0]
    qs = mtp.site_queries()
    b = mtp.block
    want = [site_query(b.self_attention_res_norm, b.self_attention_res_proj),
            site_query(b.mlp_res_norm, b.mlp_res_proj), site_query(mtp.output_attn_res_norm, mtp.output_attn_res_proj)]
    assert qs.shape == (3, tiny_cfg.hidden_size) and qs.dtype == torch.float32
    assert all(torch.equal(a, w) for a, w in zip(qs, want))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, tiny_cfg.hidden_size, generator=g).to(dtype)
    embeds = torch.randn(2, 5, tiny_cfg.hidden_size, generator=g).to(dtype)
    with torch.no_grad():
        at_once, _ = mtp(hidden, embeds)
        given, _ = mtp(hidden, embeds, queries=qs)
    each, _ = mtp(hidden, embeds)  # with gradients: each site its own
    assert torch.equal(at_once, given) and torch.equal(at_once, each.detach())
    assert make(tiny_cfg.replace(residual="plain")).mtp[0].site_queries() is None


@torch.no_grad()
def test_two_phase_attn_res_equals_direct(tiny_cfg):
    cfg = tiny_cfg.replace(num_hidden_layers=9, kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8, 9],
                           attn_res_block_size=4)
    model = make(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    direct = model(ids).logits
    model.model.two_phase_attn_res = True
    two = model(ids).logits
    assert rel_err(two, direct) < 1e-4  # per site ~1e-6 (ops test); 9 layers of fp32 rounding on top


@torch.no_grad()
def test_packed_documents_equal_separate_forwards(tiny_cfg):
    model = make(tiny_cfg, seed=4)
    lens = [23, 70, 35]
    docs = [torch.randint(0, tiny_cfg.vocab_size, (1, n)) for n in lens]
    packed = torch.cat(docs, 1)
    seg = torch.cat([torch.full((1, n), i) for i, n in enumerate(lens)], 1)
    out = model(packed, segment_ids=seg).logits
    ref = torch.cat([model(d).logits for d in docs], 1)
    assert rel_err(out, ref) < 1e-4
    # Two rows with their own documents behave the same as one row each.
    rows = torch.cat([packed[:, :64], packed[:, 64:128]], 0)
    seg_rows = torch.cat([seg[:, :64], seg[:, 64:128]], 0)
    out_rows = model(rows, segment_ids=seg_rows).logits
    ref_rows = torch.cat([model(rows[i:i + 1], segment_ids=seg_rows[i:i + 1]).logits for i in range(2)], 0)
    assert rel_err(out_rows, ref_rows) < 1e-4


def test_host_document_offsets_give_the_same_forward_and_backward(tiny_cfg):
    # The trainer builds the batch record with packed_cu_seqlens of the host copy of segment_ids (cu_seqlens_cpu) so
    # that the forward reads nothing back from the device; on CPU both ways run the same ops: loss and gradients
    # exactly equal.
    from k3.model.batch import BatchInfo
    from k3.model.model import packed_cu_seqlens

    model = make(tiny_cfg.replace(num_nextn_predict_layers=1), seed=5)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 48))
    seg = torch.zeros_like(ids)
    seg[0, 20:] = 1
    seg[1, 5:] = 1
    seg[1, 30:] = 2
    res = []
    for cu in (None, packed_cu_seqlens(seg)):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, batch=BatchInfo.from_segment_ids(seg, cu_seqlens_cpu=cu), return_logits=False)
        (out.loss + out.mtp_loss).backward()
        res.append([out.loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(res[0]) == len(res[1]) > 10
    assert all(torch.equal(a, b) for a, b in zip(*res))
    assert torch.equal(packed_cu_seqlens(seg), torch.tensor([0, 20, 48, 53, 78, 96]))
    with pytest.raises(ValueError, match="needs the segment_ids"):
        model(ids, batch=BatchInfo(cu_seqlens_cpu=packed_cu_seqlens(seg)))
    with pytest.raises(ValueError, match="1-D host tensor"):
        model(ids, batch=BatchInfo.from_segment_ids(seg, cu_seqlens_cpu=packed_cu_seqlens(seg)[None]))


def test_loss_and_mtp_loss_backpropagate(tiny_cfg):
    cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    model = make(cfg, seed=5).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    out = model(ids, labels=ids)
    # At init the loss is near log(V): the model predicts almost uniformly.
    assert abs(out.loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    assert out.mtp_loss is not None and torch.isfinite(out.mtp_loss)
    (out.loss + 0.3 * out.mtp_loss).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["mtp.0.eh_proj.weight"] is not None and grads["mtp.0.eh_proj.weight"].abs().sum() > 0
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    assert grads["model.layers.3.self_attn.kv_b_proj.weight"].abs().sum() > 0
    assert grads["model.layers.1.block_sparse_moe.experts.w1"].abs().sum() > 0
    # The router bias is a buffer: balancing sets it, gradients never do.
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" not in grads


def test_labels_ignore_index(tiny_cfg):
    model = make(tiny_cfg)
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 12))
    labels = ids.clone()
    labels[:, :6] = -100
    full = model(ids, labels=labels)
    logits = full.logits[:, 5:-1].reshape(-1, tiny_cfg.vocab_size)
    ref = torch.nn.functional.cross_entropy(logits, ids[:, 6:].reshape(-1))
    assert abs(full.loss.item() - ref.item()) < 1e-6


def test_bad_input_ids_are_reported(tiny_cfg):
    model = make(tiny_cfg)
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, tiny_cfg.vocab_size]]))
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        model(torch.tensor([1, 2, 3]))


def test_bf16_model_keeps_fp32_parameters(tiny_cfg):
    model = make(tiny_cfg).set_dtype(torch.bfloat16)
    dt = {n: p.dtype for n, p in model.named_parameters()}
    assert dt["model.layers.0.self_attn.A_log"] == torch.float32
    assert dt["model.layers.0.self_attn.q_conv1d.weight"] == torch.float32
    assert dt["model.layers.0.self_attn.o_norm.weight"] == torch.float32
    assert dt["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 20))
    with torch.no_grad():
        out = model(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_max_logit_in_query_blocks_equals_the_full_matrix():
    from k3.ops.mla import max_logit as _max_logit

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 300, 3, 24, generator=g), torch.randn(2, 300, 3, 24, generator=g)
    seg = torch.cat([torch.zeros(2, 170), torch.ones(2, 130)], 1).long()
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.3
    mask = torch.ones(300, 300, dtype=torch.bool).tril().expand(2, 1, 300, 300)
    mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    full = s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.equal(_max_logit(q, k, 0.3, seg, block=64), full)
    assert torch.equal(_max_logit(q, k, 0.3, None, block=7), _max_logit(q, k, 0.3, None, block=1000))
    # a context-parallel segment's queries (positions q_start ...) against the keys up to their end: the maxima of
    # the row's segments, taken together, are the row's (the same dot products, so exactly)
    parts = [_max_logit(q[:, a:b], k[:, :b], 0.3, seg[:, :b], block=64, q_start=a)
             for a, b in ((0, 100), (100, 171), (171, 300))]
    assert torch.equal(torch.stack(parts).amax(0), full)


def test_chunked_head_loss_equals_the_full_logits_loss_with_gradients(tiny_cfg):
    from helpers import randomize_
    from k3.model.model import K3ForCausalLM, _shifted_ce

    model = randomize_(K3ForCausalLM(tiny_cfg))
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 50, tiny_cfg.hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, tiny_cfg.vocab_size, (2, 50), generator=g)
    labels[0, 10:20] = -100
    results = []
    for fn in (lambda: _shifted_ce(model.lm_head(model.model.norm(hidden)), labels, 1),
               lambda: model.head_loss(hidden, labels, chunk_tokens=17),  # 98 rows: 6 recomputed chunks
               lambda: model.head_loss(hidden, labels)):  # one chunk
        model.zero_grad()
        loss = fn()
        gh, gw = torch.autograd.grad(loss, [hidden, model.lm_head.weight])
        results.append((loss.detach(), gh, gw))
    for loss, gh, gw in results[1:]:  # fp32, same sums in another grouping: 1e-5 relative
        assert rel_err(loss, results[0][0]) < 1e-5
        assert rel_err(gh, results[0][1]) < 1e-5 and rel_err(gw, results[0][2]) < 1e-5


def test_loss_only_forward_skips_the_logits(tiny_cfg):
    from helpers import randomize_
    from k3.model.model import K3ForCausalLM

    model = randomize_(K3ForCausalLM(tiny_cfg))
    ids = torch.randint(1, tiny_cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    full = model(ids, labels=ids)
    lean = model(ids, labels=ids, return_logits=False)
    assert lean.logits is None and rel_err(lean.loss, full.loss) < 1e-5
    if full.mtp_loss is not None:
        assert rel_err(lean.mtp_loss, full.mtp_loss) < 1e-5
    with pytest.raises(ValueError, match="return_logits=False needs labels"):
        model(ids, return_logits=False)


def test_router_logits_are_fp32_under_autocast(tiny_cfg):
    # Report §2.3.3: the router runs in fp32; bf16 autocast must not turn its matmul into bf16.
    from k3.model.latent_moe import MoEGate

    gate = next(m for m in K3ForCausalLM(tiny_cfg).init_weights(seed=0).modules() if isinstance(m, MoEGate))
    x = torch.randn(16, tiny_cfg.hidden_size).to(torch.bfloat16)
    ref = gate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate(x)
    assert got.scores.dtype == torch.float32
    assert torch.equal(got.scores, ref.scores) and torch.equal(got.indices, ref.indices)
