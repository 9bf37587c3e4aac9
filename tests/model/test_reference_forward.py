"""The model against an independent transcription of the report's equations.

`reference_logits` reads a checkpoint's tensors by their official names and computes the forward pass
in float64 with plain loops (KDA token recurrence, explicit softmax attention, per-token routing). It shares
no code with k3.ops or k3.model, so it checks the equations, the parameter names and the layout quirks
(1-based layer lists, padded A_log, per-head decay scale, AttnRes block schedule) together.
"""

import json
import math

import torch
from safetensors.torch import load_file

from helpers import randomize_, rel_err
from k3.checkpoint import from_pretrained, save_pretrained
from k3.model.model import K3ForCausalLM


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _situ(g, u, b1, b2):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


def reference_logits(ckpt_dir, ids):
    cfg = json.load(open(f"{ckpt_dir}/config.json"))
    tc = cfg["text_config"]
    lac = tc["linear_attn_config"]
    index = json.load(open(f"{ckpt_dir}/model.safetensors.index.json"))["weight_map"]
    sd = {}
    for f in sorted(set(index.values())):
        sd.update({k: v.double() for k, v in load_file(f"{ckpt_dir}/{f}").items()})
    P = "language_model.model."
    eps, L, S = tc["rms_norm_eps"], tc["num_hidden_layers"], tc["attn_res_block_size"]
    b1, b2 = tc["activation_situ_beta"], tc["activation_situ_linear_beta"]
    T = ids.shape[0]

    def site(prefix, sources):
        V = torch.stack(sources)  # [n, T, D]
        w = sd[prefix + "_norm.weight"] * sd[prefix + "_proj.weight"][0]
        score = (V / torch.sqrt((V * V).mean(-1, keepdim=True) + eps) * w).sum(-1)
        a = torch.softmax(score, dim=0)
        return (a.unsqueeze(-1) * V).sum(0)

    def kda(p, x):
        H, K = lac["num_heads"], lac["head_dim"]

        def conv_silu(y, w):  # w [C, 1, 4]; tap 3 = current token
            w = w[:, 0, :]
            out = torch.zeros_like(y)
            for t in range(T):
                for i in range(4):
                    s = t - 3 + i
                    if s >= 0:
                        out[t] += w[:, i] * y[s]
            return out * torch.sigmoid(out)

        q = conv_silu(x @ sd[p + "q_proj.weight"].T, sd[p + "q_conv1d.weight"]).view(T, H, K)
        k = conv_silu(x @ sd[p + "k_proj.weight"].T, sd[p + "k_conv1d.weight"]).view(T, H, K)
        v = conv_silu(x @ sd[p + "v_proj.weight"].T, sd[p + "v_conv1d.weight"]).view(T, H, K)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        A = sd[p + "A_log"][:H]  # stored padded to 128; one scale per head
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
        kv = (_rms(c, sd[p + "kv_a_layernorm.weight"], 1e-6) @ sd[p + "kv_b_proj.weight"].T).view(T, H, dn + dv)
        o = torch.zeros(T, H, dv, dtype=torch.float64)
        for h in range(H):
            kh = torch.cat([kv[:, h, :dn], kr], -1)
            s = q[:, h] @ kh.T / math.sqrt(dn + dr)
            s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            o[:, h] = torch.softmax(s, -1) @ kv[:, h, dn:]
        o = o.reshape(T, H * dv) * torch.sigmoid(x @ sd[p + "g_proj.weight"].T)
        return o @ sd[p + "o_proj.weight"].T

    def mlp(p, x):
        return _situ(x @ sd[p + "gate_proj.weight"].T, x @ sd[p + "up_proj.weight"].T, b1, b2) @ sd[p + "down_proj.weight"].T

    def moe(p, x):
        k = tc["num_experts_per_token"]
        s = torch.sigmoid(x @ sd[p + "gate.weight"].T)
        sel = torch.topk(s + sd[p + "gate.e_score_correction_bias"], k, dim=-1).indices
        z = x @ sd[p + "routed_expert_down_proj.weight"].T
        u = torch.zeros_like(z)
        for t in range(T):
            pw = s[t, sel[t]] / s[t, sel[t]].sum() * tc["routed_scaling_factor"]
            for j, e in enumerate(sel[t].tolist()):
                w1, w3, w2 = (sd[f"{p}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
                u[t] += pw[j] * (w2 @ _situ(w1 @ z[t], w3 @ z[t], b1, b2))
        y = _rms(u, sd[p + "routed_expert_norm.weight"], eps) @ sd[p + "routed_expert_up_proj.weight"].T
        return y + mlp(p + "shared_experts.", x)

    blocks, partial = [], sd[P + "embed_tokens.weight"][ids]
    for l in range(L):
        p = f"{P}layers.{l}."
        h = partial if not blocks else site(p + "self_attention_res", blocks + [partial])
        if l % S == 0:
            blocks, partial = blocks + [partial], None
        x = _rms(h, sd[p + "input_layernorm.weight"], eps)
        a = kda(p + "self_attn.", x) if (l + 1) in lac["kda_layers"] else mla(p + "self_attn.", x)
        partial = a if partial is None else partial + a
        x = _rms(site(p + "mlp_res", blocks + [partial]), sd[p + "post_attention_layernorm.weight"], eps)
        partial = partial + (mlp(p + "mlp.", x) if l < tc["first_k_dense_replace"] else moe(p + "block_sparse_moe.", x))
    h = site(P + "output_attn_res", blocks + [partial])
    return _rms(h, sd[P + "norm.weight"], eps) @ sd["language_model.lm_head.weight"].T


@torch.no_grad()
def test_model_matches_independent_reference(tiny_cfg, tmp_path):
    model = randomize_(K3ForCausalLM(tiny_cfg), seed=11)
    save_pretrained(model, tmp_path / "ck")
    loaded = from_pretrained(tmp_path / "ck")
    ids = torch.randint(0, tiny_cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    ours = loaded(ids).logits[0]
    ref = reference_logits(tmp_path / "ck", ids[0])
    assert rel_err(ours, ref) < 1e-4
