"""The ablation arms (config fields that are not K3, `K3Config.ablations`): each arm's forward against a written-out
float64 reference of that arm, read from a saved checkpoint by the official names (so the arm also round-trips
through save_pretrained / from_pretrained); K3's own path is the independent reference of test_reference_forward."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from helpers import randomize_, rel_err
from k3.checkpoint import from_pretrained, save_pretrained
from k3.config import ConfigError, K3Config, layer_lists
from k3.model.batch import BatchInfo
from k3.model.gated_mla import GatedMLA
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends


def _pattern(p: str) -> dict:
    kda, full = layer_lists(p)
    return {"kda_layers": kda, "full_attn_layers": full}


# arm -> (the config change, the field its ablations() line names)
ARMS = {
    "all_mla": (_pattern("MMMMM"), "layers MMMMM"),
    "all_kda": (_pattern("KKKKK"), "layers KKKKK"),
    "pattern": (_pattern("MKMKK"), "layers MKMKK"),
    "rope": ({"mla_use_nope": False, "rope_theta": 500.0}, "mla_use_nope=false"),
    "ungated": ({"mla_use_output_gate": False}, "mla_use_output_gate=false"),
    "plain": ({"residual": "plain"}, "residual=plain"),
    "moe": ({"moe_latent": False}, "moe_latent=false"),
}


def _rms(x, w, eps):
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def _situ(g, u, b1, b2):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


def _rotate(x, positions, theta):
    """RoPE written out pair by pair: dims i and i + d/2 turn by angle p * theta^(-2i/d) at position p."""
    d = x.shape[-1]
    out = x.clone()
    for t, p in enumerate(positions):
        for i in range(d // 2):
            a = p * theta ** (-2 * i / d)
            x1, x2 = x[t, ..., i], x[t, ..., i + d // 2]
            out[t, ..., i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[t, ..., i + d // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def reference_logits(ckpt_dir, ids):
    """The arm's forward in float64 from the checkpoint's tensors and config.json, every arm written out: the
    layer lists, RoPE (mla_use_nope false), the ungated MLA, plain residuals h = h + f(norm(h)) and the MoE with its
    experts in the hidden width. Shares no code with k3.ops or k3.model."""
    tc = json.load(open(f"{ckpt_dir}/config.json"))["text_config"]
    lac = tc["linear_attn_config"]
    index = json.load(open(f"{ckpt_dir}/model.safetensors.index.json"))["weight_map"]
    sd = {}
    for f in sorted(set(index.values())):
        sd.update({k: v.double() for k, v in load_file(f"{ckpt_dir}/{f}").items()})
    P = "language_model.model."
    eps, L, S = tc["rms_norm_eps"], tc["num_hidden_layers"], tc["attn_res_block_size"]
    b1, b2 = tc["activation_situ_beta"], tc["activation_situ_linear_beta"]
    rope, gated = not tc["mla_use_nope"], tc["mla_use_output_gate"]
    plain, latent = tc.get("residual", "attn_res") == "plain", tc.get("moe_latent", True)
    T = ids.shape[0]

    def site(prefix, sources):
        V = torch.stack(sources)
        w = sd[prefix + "_norm.weight"] * sd[prefix + "_proj.weight"][0]
        a = torch.softmax((_rms(V, None, eps) * w).sum(-1), dim=0)
        return (a.unsqueeze(-1) * V).sum(0)

    def kda(p, x):
        H, K = lac["num_heads"], lac["head_dim"]

        def conv_silu(y, w):
            w = w[:, 0, :]
            out = torch.zeros_like(y)
            for t in range(T):
                for i in range(4):
                    if t - 3 + i >= 0:
                        out[t] += w[:, i] * y[t - 3 + i]
            return out * torch.sigmoid(out)

        q = conv_silu(x @ sd[p + "q_proj.weight"].T, sd[p + "q_conv1d.weight"]).view(T, H, K)
        k = conv_silu(x @ sd[p + "k_proj.weight"].T, sd[p + "k_conv1d.weight"]).view(T, H, K)
        v = conv_silu(x @ sd[p + "v_proj.weight"].T, sd[p + "v_conv1d.weight"]).view(T, H, K)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        A = sd[p + "A_log"][:H]
        z = (x @ sd[p + "f_a_proj.weight"].T @ sd[p + "f_b_proj.weight"].T + sd[p + "dt_bias"]).view(T, H, K)
        g = lac["gate_lower_bound"] * torch.sigmoid(torch.exp(A)[None, :, None] * z)
        beta = torch.sigmoid(x @ sd[p + "b_proj.weight"].T)
        o = torch.zeros(T, H, K, dtype=torch.float64)
        for h in range(H):
            Sm = torch.zeros(K, K, dtype=torch.float64)
            for t in range(T):
                Sm = torch.diag(torch.exp(g[t, h])) @ Sm
                Sm = Sm + beta[t, h] * torch.outer(k[t, h], v[t, h] - k[t, h] @ Sm)
                o[t, h] = Sm.T @ q[t, h]
        o = _rms(o, sd[p + "o_norm.weight"], eps) * torch.sigmoid(x @ sd[p + "g_proj.weight"].T).view(T, H, K)
        return o.reshape(T, H * K) @ sd[p + "o_proj.weight"].T

    def mla(p, x):
        H, dn, dr, dv, r = (tc["num_attention_heads"], tc["qk_nope_head_dim"], tc["qk_rope_head_dim"],
                            tc["v_head_dim"], tc["kv_lora_rank"])
        q = (_rms(x @ sd[p + "q_a_proj.weight"].T, sd[p + "q_a_layernorm.weight"], 1e-6)
             @ sd[p + "q_b_proj.weight"].T).view(T, H, dn + dr)
        ckv = x @ sd[p + "kv_a_proj_with_mqa.weight"].T
        c, kr = ckv[:, :r], ckv[:, r:]
        if rope:  # positions 0 .. T-1: one document
            q = torch.cat([q[..., :dn], _rotate(q[..., dn:], range(T), tc["rope_theta"])], -1)
            kr = _rotate(kr, range(T), tc["rope_theta"])
        kv = (_rms(c, sd[p + "kv_a_layernorm.weight"], 1e-6) @ sd[p + "kv_b_proj.weight"].T).view(T, H, dn + dv)
        o = torch.zeros(T, H, dv, dtype=torch.float64)
        for h in range(H):
            s = q[:, h] @ torch.cat([kv[:, h, :dn], kr], -1).T / math.sqrt(dn + dr)
            s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            o[:, h] = torch.softmax(s, -1) @ kv[:, h, dn:]
        o = o.reshape(T, H * dv)
        if gated:
            o = o * torch.sigmoid(x @ sd[p + "g_proj.weight"].T)
        return o @ sd[p + "o_proj.weight"].T

    def mlp(p, x):
        return _situ(x @ sd[p + "gate_proj.weight"].T, x @ sd[p + "up_proj.weight"].T, b1, b2) @ sd[p + "down_proj.weight"].T

    def moe(p, x):
        k = tc["num_experts_per_token"]
        s = torch.sigmoid(x @ sd[p + "gate.weight"].T)
        sel = torch.topk(s + sd[p + "gate.e_score_correction_bias"], k, dim=-1).indices
        z = x @ sd[p + "routed_expert_down_proj.weight"].T if latent else x  # standard MoE: the hidden width
        u = torch.zeros_like(z)
        for t in range(T):
            pw = s[t, sel[t]] / s[t, sel[t]].sum() * tc["routed_scaling_factor"]
            for j, e in enumerate(sel[t].tolist()):
                w1, w3, w2 = (sd[f"{p}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
                u[t] += pw[j] * (w2 @ _situ(w1 @ z[t], w3 @ z[t], b1, b2))
        y = _rms(u, sd[p + "routed_expert_norm.weight"], eps) @ sd[p + "routed_expert_up_proj.weight"].T if latent else u
        return y + mlp(p + "shared_experts.", x)

    def ffn(p, l, x):
        return mlp(p + "mlp.", x) if l < tc["first_k_dense_replace"] else moe(p + "block_sparse_moe.", x)

    def mixer(p, l, x):
        return kda(p + "self_attn.", x) if (l + 1) in lac["kda_layers"] else mla(p + "self_attn.", x)

    h = sd[P + "embed_tokens.weight"][ids]
    if plain:  # h = h + sublayer(norm(h)), twice per layer
        for l in range(L):
            p = f"{P}layers.{l}."
            h = h + mixer(p, l, _rms(h, sd[p + "input_layernorm.weight"], eps))
            h = h + ffn(p, l, _rms(h, sd[p + "post_attention_layernorm.weight"], eps))
    else:  # Block AttnRes, as test_reference_forward
        blocks, partial = [], h
        for l in range(L):
            p = f"{P}layers.{l}."
            h = partial if not blocks else site(p + "self_attention_res", blocks + [partial])
            if l % S == 0:
                blocks, partial = blocks + [partial], None
            a = mixer(p, l, _rms(h, sd[p + "input_layernorm.weight"], eps))
            partial = a if partial is None else partial + a
            x = _rms(site(p + "mlp_res", blocks + [partial]), sd[p + "post_attention_layernorm.weight"], eps)
            partial = partial + ffn(p, l, x)
        h = site(P + "output_attn_res", blocks + [partial])
    return _rms(h, sd[P + "norm.weight"], eps) @ sd["language_model.lm_head.weight"].T


def _arm(tiny_cfg, arm):
    return tiny_cfg.replace(**ARMS[arm][0])


# --- the config -------------------------------------------------------------------------------------------
def test_k3_has_no_ablations_and_each_arm_names_its_field(tiny_cfg, tmp_path):
    for preset in ("k3", "k3-mini", "tiny"):
        cfg = K3Config.from_preset(preset)
        assert cfg.ablations() == []
        d = cfg.to_dict()
        assert "k3_ablation" not in d  # K3's config.json has the release's keys only
        assert not {"residual", "moe_latent", "rope_theta"} & set(d["text_config"])
    for arm, (change, named) in ARMS.items():
        cfg = _arm(tiny_cfg, arm)
        assert len(cfg.ablations()) == 1 and cfg.ablations()[0].startswith(named), (arm, cfg.ablations())
        cfg.save(tmp_path / f"{arm}.json")
        d = json.load(open(tmp_path / f"{arm}.json"))
        assert d["k3_ablation"] == cfg.ablations()
        assert K3Config.load(tmp_path / f"{arm}.json", strict=True) == cfg
    d = tiny_cfg.to_dict()
    d["text_config"]["rope_theta"] = None  # what transformers may write for a NoPE model: unused, K3 all the same
    assert K3Config.from_dict(d) == tiny_cfg
    both = tiny_cfg.replace(residual="plain", moe_latent=False)
    assert [a.split(":")[0] for a in both.ablations()] == ["residual=plain", "moe_latent=false"]


@pytest.mark.parametrize("change, message", [
    ({"residual": "highway"}, "residual"),
    ({"moe_latent": 0}, "moe_latent"),
    ({"mla_use_nope": False, "qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"mla_use_nope": False, "qk_rope_head_dim": 0}, "qk_rope_head_dim"),
    ({"rope_theta": -1.0}, "rope_theta"),
])
def test_bad_arm_values_name_the_field(tiny_cfg, change, message):
    with pytest.raises(ConfigError, match=message):
        tiny_cfg.replace(**change)


def test_layer_pattern_strings():
    cfg = K3Config.from_preset("k3-mini")
    assert layer_lists("KKKMKKKMKKKMM") == (cfg.kda_layers, cfg.full_attn_layers)
    with pytest.raises(ConfigError, match="one letter per layer"):
        layer_lists("KKXM")


def test_k3_info_names_the_arms(tiny_cfg, tmp_path, capsys):
    from k3.cli import main

    cfg = tiny_cfg.replace(residual="plain", mla_use_nope=False)
    cfg.save(tmp_path / "config.json")
    assert main(["info", str(tmp_path / "config.json")]) == 0
    out = capsys.readouterr().out
    assert "ablation arm, not K3: mla_use_nope=false: RoPE (theta 10000) on the MLA rope slice, not NoPE; " \
           "residual=plain: plain residuals instead of Block AttnRes" in out
    assert main(["info", "tiny"]) == 0
    assert "ablation" not in capsys.readouterr().out


# --- each arm against its reference ---------------------------------------------------------------------
@pytest.mark.parametrize("arm", list(ARMS))
@torch.no_grad()
def test_arm_matches_its_reference(tiny_cfg, tmp_path, arm):
    # fp32 model against the float64 reference: 1e-4 relative, as test_reference_forward.
    cfg = _arm(tiny_cfg, arm)
    model = randomize_(K3ForCausalLM(cfg), seed=11)
    save_pretrained(model, tmp_path / "ck")
    loaded = from_pretrained(tmp_path / "ck")
    assert loaded.config == cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    ours = loaded(ids).logits[0]
    ref = reference_logits(tmp_path / "ck", ids[0])
    assert rel_err(ours, ref) < 1e-4


def test_arms_change_the_model(tiny_cfg):
    # RoPE keeps K3's tensors and changes the function; the other arms drop K3's tensors of what they remove.
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        k3_logits = randomize_(K3ForCausalLM(tiny_cfg), seed=5)(ids).logits
        rope = randomize_(K3ForCausalLM(_arm(tiny_cfg, "rope")), seed=5)
        assert rel_err(rope(ids).logits, k3_logits) > 1e-3
    assert set(rope.state_dict()) == set(K3ForCausalLM(tiny_cfg).state_dict())
    ungated = K3ForCausalLM(_arm(tiny_cfg, "ungated").replace(num_nextn_predict_layers=1))
    assert all(layer.self_attn.g_proj is None for layer in ungated.model.layers if not layer.is_kda)
    assert ungated.mtp[0].block.self_attn.g_proj is None
    assert not [n for n in K3ForCausalLM(_arm(tiny_cfg, "plain")).state_dict() if "attn_res" in n]
    moe = K3ForCausalLM(_arm(tiny_cfg, "moe"))
    assert not [n for n in moe.state_dict() if "routed_expert_" in n]
    E, F, D = tiny_cfg.num_experts, tiny_cfg.moe_intermediate_size, tiny_cfg.hidden_size
    assert moe.model.layers[1].block_sparse_moe.experts.w1.shape == (E, F, D)
    layers = K3ForCausalLM(_arm(tiny_cfg, "all_kda")).model.layers
    assert all(layer.is_kda for layer in layers)
    assert not any(layer.is_kda for layer in K3ForCausalLM(_arm(tiny_cfg, "all_mla")).model.layers)


def test_activation_checkpointing_keeps_each_arms_loss_and_gradients(tiny_cfg):
    # fp32: the recompute runs the same ops on the same inputs, so loss and gradients are bitwise the plain ones.
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    seg = torch.zeros_like(ids)
    seg[0, 10:] = 1
    for arm in ARMS:
        cfg = _arm(tiny_cfg, arm).replace(num_nextn_predict_layers=1)
        runs = []
        for on in (False, True):
            m = randomize_(K3ForCausalLM(cfg), seed=4).train().set_activation_checkpointing(on)
            out = m(ids, labels=ids, segment_ids=seg)
            (out.loss + out.mtp_loss).backward()
            runs.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        (l0, g0), (l1, g1) = runs
        assert torch.equal(l0, l1) and g0.keys() == g1.keys(), arm
        assert all(torch.equal(g0[n], g1[n]) for n in g0), arm


# --- RoPE positions ---------------------------------------------------------------------------------------
@torch.no_grad()
def test_rope_positions_restart_per_document_and_follow_the_cache(tiny_cfg):
    cfg = _arm(tiny_cfg, "rope").replace(num_nextn_predict_layers=0)
    model = randomize_(K3ForCausalLM(cfg), seed=2).eval()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, cfg.vocab_size, (1, 9), generator=g), torch.randint(1, cfg.vocab_size, (1, 7), generator=g)
    packed = torch.cat([a, b], 1)
    seg = torch.tensor([[0] * 9 + [1] * 7])
    out = model(packed, segment_ids=seg).logits
    assert rel_err(out[:, :9], model(a).logits) < 1e-5 and rel_err(out[:, 9:], model(b).logits) < 1e-5
    # decode through the model's own cache: positions continue after the cached rows. fp32 rounding of two orders of
    # computation (token recurrence and the absorbed attention against the chunked KDA and the expanded attention):
    # 1.07e-5 of the largest logit with torch on one thread (as each worker of the parallel suite runs), below 1e-5
    # on two
    cache = model.new_cache()
    steps = [model(packed[:, :5], cache=cache).logits] + [model(packed[:, t:t + 1], cache=cache).logits
                                                          for t in range(5, 16)]
    assert rel_err(torch.cat(steps, 1), model(packed).logits) < 3e-5


def test_rope_refuses_context_parallelism(tiny_cfg):
    layer = GatedMLA(_arm(tiny_cfg, "rope"), 3)
    batch = BatchInfo(segment_ids=torch.zeros(1, 4, dtype=torch.long), context=object())
    with pytest.raises(ValueError, match="context parallelism"):
        layer(torch.randn(1, 4, tiny_cfg.hidden_size), batch=batch)


# --- training and serving each arm --------------------------------------------------------------------------
SERVE_ARMS = list(ARMS)


def _greedy_without_cache(model, prompt, n):
    """Greedy tokens by a full forward over the whole sequence at every step (no cache: positions from scratch)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arm", SERVE_ARMS)
def test_each_arm_trains_a_step_and_serves(tmp_path, arm):
    import numpy as np

    from k3.data.packing import PackedLoader
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams
    from k3.serve.scheduler import SchedulerConfig
    from k3.train.trainer import TrainConfig, Trainer

    cfg = K3Config.from_preset("tiny").replace(vocab_size=256, eos_token_id=0, pad_token_id=0, **ARMS[arm][0])
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).init_weights(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stream = np.random.default_rng(0).integers(1, 256, size=4000).astype(np.int32)
    tc = TrainConfig(out=str(tmp_path / "run"), max_steps=1, seq_len=32, batch_tokens=64, eval_every=10**6,
                     eval_batches=1, save_every_minutes=1e9)
    loader = PackedLoader(stream, tc.seq_len, tc.rows_per_step, eos_id=0, seed=0)
    summary = Trainer(model, tc, loader, eos_id=0, log=lambda *a: None).fit(progress_bar=False)
    assert summary["step"] == 1 and math.isfinite(summary["last_loss"] if "last_loss" in summary else 0.0)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) > len(before) // 2
    served = from_pretrained(summary["checkpoint"])  # the run's checkpoint keeps the arm
    assert served.config == cfg and served.config.ablations() == cfg.ablations()
    served.eval()
    with torch.no_grad():
        served.lm_head.weight.mul_(40)  # wide logit gaps: greedy choices do not hinge on last-bit rounding
    g = torch.Generator().manual_seed(3)
    base = torch.randint(1, 256, (40,), generator=g).tolist()
    prompts = [base[:23], base[:37], base[5:14]]  # the second extends the first: a prefix-cache hit
    want = [_greedy_without_cache(served, p, 4) for p in prompts]
    # the eager forwards, MTP speculation, and decode steps over static buffers (a CUDA graph's, not captured)
    for speculative, graphs in (("off", False), ("mtp", False), ("off", "eager")):
        served.set_backends(Backends(per_op={"mla_decode": "triton", "moe": "grouped"}) if graphs else None)
        eng = LLMEngine(served, None, EngineConfig(
            cache_memory_mb=4.0, page_tokens=16, hash_block_tokens=8, speculative=speculative, cuda_graphs=graphs,
            scheduler=SchedulerConfig(max_step_tokens=64, prefill_chunk=16, max_num_seqs=4)))
        assert (eng.runner.graphs is not None) == bool(graphs)
        assert eng.scheduler.cache.prefix.enable == (arm != "all_kda")  # its index keys on MLA pages
        eng.eos_id = None
        seqs = []
        for p in prompts:
            seqs.append(eng.add_request(list(p), SamplingParams(max_tokens=4, temperature=0)))
            eng.step()
        while eng.has_work():
            eng.step()
        assert [s.output_ids for s in seqs] == want, (arm, speculative, graphs)


def test_prefix_cache_without_mla_layers_is_refused_unless_off():
    from k3.serve.cache.prefix import PrefixCache

    with pytest.raises(ValueError, match="without MLA layers serves with enable=False"):
        PrefixCache(8, 0, 5)
    cache = PrefixCache(8, 0, 5, enable=False)
    adm = cache.admit("a", list(range(40)))
    assert adm.hit_tokens == 0 and adm.mla_tables == [] and len(adm.kda_pages) == 5
    assert cache.ensure_capacity("a", 60) == []
    cache.register_tokens("a", list(range(60)))
