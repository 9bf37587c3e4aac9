import json

import pytest

from k3.config import ConfigError, K3Config
from k3.info import model_info


def test_k3_preset_is_the_release():
    c = K3Config.from_preset("k3")
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.rms_norm_eps) == (93, 7168, 163840, 1e-5)
    mla0 = [i - 1 for i in c.full_attn_layers]
    assert mla0 == list(range(3, 92, 4)) + [92] and len(c.kda_layers) == 69
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_short_conv_kernel_size, c.kda_gate_lower_bound) == (96, 128, 4, -5.0)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim) == (96, 1536, 512, 128, 64, 128)
    assert (c.intermediate_size, c.num_experts, c.num_experts_per_token, c.num_shared_experts,
            c.moe_intermediate_size, c.routed_expert_hidden_size) == (33792, 896, 16, 2, 3072, 3584)
    assert (c.activation_situ_beta, c.activation_situ_linear_beta, c.attn_res_block_size) == (4.0, 25.0, 12)
    assert c.num_attn_res_blocks + 1 == 9  # 8 blocks (last partial) + embedding at the output site
    assert not c.tie_word_embeddings and c.first_k_dense_replace == 1


def test_k3_counts_from_module_shapes():
    info = model_info(K3Config.from_preset("k3"))
    # checkpoint-layout §2.9: 2,779,484,478,208 with A_log stored padded to 128 (69 x 32 zero entries more).
    assert info.total == 2_779_484_478_208 - 69 * 32
    assert round(info.total / 1e12, 2) == 2.78
    assert round(info.active / 1e9, 2) == 104.19
    assert info.kda_state_bytes == 69 * 96 * 128 * 128 * 4 == 434_110_464
    assert info.mla_cache_bytes_per_token == 24 * 576 * 2
    assert info.mla_cache_bytes_per_token * 2**20 == 27 * 2**30
    assert info.breakdown["routed experts"][0] == 92 * 896 * 33_030_144


@pytest.mark.parametrize("preset", ["k3-mini", "tiny"])
def test_small_presets_keep_the_topology(preset):
    c = K3Config.from_preset(preset)
    L = c.num_hidden_layers
    assert not c.is_kda_layer(L - 1)  # last layer is MLA
    assert all(not c.is_kda_layer(i) for i in range(3, L, 4))  # every 4th is MLA
    assert sum(c.is_kda_layer(i) for i in range(L)) == L - len(c.full_attn_layers)
    assert c.first_k_dense_replace == 1 and not c.is_moe_layer(0) and c.is_moe_layer(1)
    assert c.num_attn_res_blocks >= 3 and c.num_shared_experts == 2
    if preset == "k3-mini":
        info = model_info(c)
        assert 1e9 <= info.total <= 3e9 and 150e6 <= info.active <= 400e6
        assert c.num_experts >= 64 and c.num_experts_per_token >= 4


def test_official_json_round_trip(tmp_path):
    c = K3Config.from_preset("k3")
    c.save(tmp_path / "config.json")
    d = json.load(open(tmp_path / "config.json"))
    assert d["model_type"] == "kimi_k3" and d["text_config"]["model_type"] == "kimi_linear"
    lac = d["text_config"]["linear_attn_config"]
    assert lac["kda_layers"][:4] == [1, 2, 3, 5] and lac["full_attn_layers"][-2:] == [92, 93]
    assert d["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert K3Config.load(tmp_path) == c


def test_reads_official_layer_lists_one_based():
    d = K3Config.from_preset("tiny").to_dict()
    d["text_config"]["linear_attn_config"]["kda_layers"] = [1, 3, 4]
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [2, 5]
    c = K3Config.from_dict(d)
    assert [i for i in range(5) if c.is_kda_layer(i)] == [0, 2, 3]


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"num_experts_per_token": 99}, "num_experts_per_token"),
    ({"linear_attn_config": {"gate_lower_bound": 1.0}}, "gate_lower_bound"),
    ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"eos_token_id": 10**9}, "eos_token_id"),
    ({"mla_use_nope": "no"}, "mla_use_nope"),
    ({"dtype": "int8"}, "dtype"),
])
def test_bad_values_name_the_field(change, field):
    d = K3Config.from_preset("tiny").to_dict()
    for k, v in change.items():
        if isinstance(v, dict):
            d["text_config"][k].update(v)
        else:
            d["text_config"][k] = v
    with pytest.raises(ConfigError, match=field):
        K3Config.from_dict(d)


def test_inconsistent_layer_lists_are_refused():
    d = K3Config.from_preset("tiny").to_dict()
    lac = d["text_config"]["linear_attn_config"]
    lac["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="every layer"):
        K3Config.from_dict(d)
    lac["kda_layers"] = [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="also listed"):
        K3Config.from_dict(d)
    lac["kda_layers"] = [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="1-based"):
        K3Config.from_dict(d)


def test_unreadable_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.load(tmp_path)
    with pytest.raises(ConfigError, match="no config file"):
        K3Config.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="unknown preset"):
        K3Config.from_preset("k4")


def test_mtp_active_parameters_for_training_flops():
    # The MTP layer's per-token parameters in training: its block's matrices with the routed experts at k/E,
    # plus one more pass through the shared output head; none without MTP.
    cfg = K3Config.from_preset("k3-mini")
    info = model_info(cfg)
    from k3.info import build_meta_model

    model = build_meta_model(cfg)
    mtp = model.mtp[0]
    experts = sum(p.numel() for n, p in mtp.named_parameters() if ".experts." in n)
    matrices = sum(p.numel() for n, p in mtp.named_parameters() if p.dim() > 1 and ".experts." not in n)
    k_over_e = cfg.num_experts_per_token / cfg.num_experts
    assert info.mtp_active == round(matrices + experts * k_over_e) + cfg.hidden_size * cfg.vocab_size
    assert 0.1 * info.active < info.mtp_active < 0.3 * info.active
    assert model_info(cfg.replace(num_nextn_predict_layers=0)).mtp_active == 0
