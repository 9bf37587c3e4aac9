import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import k3
from helpers import randomize_
from k3.checkpoint import CheckpointError, from_pretrained, save_pretrained
from k3.cli import main as cli_main
from k3.model.model import K3ForCausalLM
from k3.ops.mx import mxfp4_fake_quantize


def _save(cfg, path, seed=0):
    model = randomize_(K3ForCausalLM(cfg), seed=seed).eval()
    save_pretrained(model, path)
    return model


def _disk(path):
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    return index, {k: v for f in set(index["weight_map"].values()) for k, v in load_file(os.path.join(path, f)).items()}


@torch.no_grad()
def test_save_then_load_gives_identical_logits(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    model = _save(cfg, tmp_path / "ck")
    loaded = k3.from_pretrained(tmp_path / "ck")
    ids = torch.randint(0, cfg.vocab_size, (2, 19))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_official_names_and_quirks_on_disk(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    model = _save(cfg, tmp_path / "ck")
    index, sd = _disk(tmp_path / "ck")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert all(f.startswith("model-00001-of-00000") for f in set(index["weight_map"].values()))
    P = "language_model.model."
    for name in ["embed_tokens.weight", "norm.weight", "output_attn_res_norm.weight", "output_attn_res_proj.weight",
                 "layers.0.mlp.gate_proj.weight", "layers.0.self_attn.q_conv1d.weight",
                 "layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "layers.1.block_sparse_moe.experts.7.w2.weight", "layers.3.self_attn.kv_a_proj_with_mqa.weight",
                 "layers.5.eh_proj.weight", "layers.5.self_attn.q_b_proj.weight"]:  # layer 5 = the MTP layer
        assert P + name in sd, name
    assert "language_model.lm_head.weight" in sd
    a_log = sd[P + "layers.0.self_attn.A_log"]
    H = cfg.kda_num_heads
    assert a_log.shape == (128,) and a_log.dtype == torch.float32 and torch.all(a_log[H:] == 0)
    assert torch.equal(a_log[:H], model.model.layers[0].self_attn.A_log.detach())
    assert sd[P + "layers.0.self_attn.q_conv1d.weight"].shape == (H * cfg.kda_head_dim, 1, 4)
    assert sd[P + "layers.1.block_sparse_moe.experts.7.w1.weight"].shape == (cfg.moe_intermediate_size,
                                                                           cfg.routed_expert_hidden_size)
    assert sd[P + "layers.0.self_attention_res_proj.weight"].shape == (1, cfg.hidden_size)


def test_bf16_checkpoint_keeps_the_fp32_set(tiny_cfg, tmp_path):
    model = randomize_(K3ForCausalLM(tiny_cfg.replace(dtype="bfloat16"))).set_dtype(torch.bfloat16)
    save_pretrained(model, tmp_path / "ck")
    _, sd = _disk(tmp_path / "ck")
    P = "language_model.model.layers."
    fp32 = {k for k, v in sd.items() if v.dtype == torch.float32}
    assert fp32 == {k for k in sd if k.endswith(("A_log", "dt_bias", "conv1d.weight", "o_norm.weight",
                                                  "e_score_correction_bias"))}
    assert sd[P + "1.block_sparse_moe.gate.weight"].dtype == torch.bfloat16
    assert from_pretrained(tmp_path / "ck").model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


@torch.no_grad()
def test_mxfp4_experts_round_trip(tiny_cfg, tmp_path):
    q = k3.K3Config.from_preset("k3").quantization_config
    cfg = tiny_cfg.replace(quantization_config=q)
    model = _save(cfg, tmp_path / "ck")
    _, sd = _disk(tmp_path / "ck")
    P = "language_model.model.layers.1.block_sparse_moe.experts.3."
    assert sd[P + "w1.weight_packed"].dtype == torch.uint8
    assert sd[P + "w1.weight_packed"].shape == (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size // 2)
    assert sd[P + "w2.weight_scale"].shape == (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size // 32)
    assert not any(k.endswith("experts.3.w1.weight") for k in sd)
    loaded = from_pretrained(tmp_path / "ck")
    w = model.model.layers[1].block_sparse_moe.experts.w1[3]
    assert torch.equal(loaded.model.layers[1].block_sparse_moe.experts.w1[3], mxfp4_fake_quantize(w))
    # Values that are already MXFP4-exact (as the release's QAT weights are) decode bit-exactly.
    save_pretrained(loaded, tmp_path / "ck2")
    again = from_pretrained(tmp_path / "ck2")
    for a, b in zip(loaded.parameters(), again.parameters()):
        assert torch.equal(a, b)


@torch.no_grad()
def test_load_first_layers_only(tiny_cfg, tmp_path):
    model = _save(tiny_cfg, tmp_path / "ck")
    part = from_pretrained(tmp_path / "ck", layers=2)
    assert len(part.model.layers) == 2 and part.config.num_hidden_layers == 2
    full = model.state_dict()
    for n, t in part.state_dict().items():
        assert torch.equal(t, full[n]), n
    with pytest.raises(CheckpointError, match="layers"):
        from_pretrained(tmp_path / "ck", layers=9)


def _rewrite_shard(path, fn):
    index = json.load(open(path / "model.safetensors.index.json"))
    f = path / sorted(set(index["weight_map"].values()))[0]
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)
    # record the new file's digest, so that the load reaches the structural checks under test
    index["metadata"]["k3_sha256"][f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named(tiny_cfg, tmp_path):
    _save(tiny_cfg, tmp_path)
    _rewrite_shard(tmp_path, lambda sd: sd.pop("language_model.model.layers.2.self_attn.g_proj.weight"))
    with pytest.raises(CheckpointError, match="layers.2.self_attn.g_proj.weight"):
        from_pretrained(tmp_path)


def test_misshaped_and_unexpected_tensors_are_named(tiny_cfg, tmp_path):
    _save(tiny_cfg, tmp_path)

    def edit(sd):
        sd["language_model.model.layers.3.self_attn.o_proj.weight"] = torch.zeros(3, 3)
        sd["language_model.model.layers.0.surprise.weight"] = torch.zeros(2)

    _rewrite_shard(tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        from_pretrained(tmp_path)
    msg = str(e.value)
    assert "layers.3.self_attn.o_proj.weight" in msg and "(3, 3)" in msg and "surprise" in msg


def test_truncated_shard_is_refused(tiny_cfg, tmp_path):
    _save(tiny_cfg, tmp_path)
    shard = next(p for p in tmp_path.iterdir() if p.suffix == ".safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        from_pretrained(tmp_path)


def test_missing_shard_and_missing_dir(tiny_cfg, tmp_path):
    _save(tiny_cfg, tmp_path / "ck")
    shard = next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors")
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        from_pretrained(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="does not exist"):
        from_pretrained(tmp_path / "nope")


def test_failed_save_keeps_the_last_good_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    model = _save(tiny_cfg, tmp_path / "ck")
    import k3.checkpoint as ck

    def boom(path, *a, **k):  # the disk fills up in the middle of a shard
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(ck, "write_safetensors", boom)
    other = randomize_(K3ForCausalLM(tiny_cfg), seed=9)
    with pytest.raises(OSError):
        save_pretrained(other, tmp_path / "ck")
    monkeypatch.undo()
    loaded = from_pretrained(tmp_path / "ck")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not (tmp_path / "ck.partial").exists()


def test_cli_init_and_info(tmp_path, capsys):
    assert cli_main(["init", "--preset", "tiny", "--out", str(tmp_path / "t"), "--seed", "3"]) == 0
    model = from_pretrained(tmp_path / "t")
    assert (tmp_path / "t" / "tokenizer.json").exists()
    from k3.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tmp_path / "t")
    text = "def f(x):\n    return x + 1  # é"
    assert tok.decode(tok.encode(text).ids) == text
    ids = torch.tensor([tok.encode(text).ids])
    assert torch.isfinite(model(ids).logits).all()
    assert cli_main(["info", str(tmp_path / "t")]) == 0
    assert cli_main(["info", "k3"]) == 0
    out = capsys.readouterr().out
    assert "2.779T" in out and "104.2B" in out and "434.1 MB" in out and "27 GiB" in out
    with pytest.raises(SystemExit, match="raise --max-gib"):
        cli_main(["init", "--preset", "k3", "--out", str(tmp_path / "big")])


def test_config_dtype_records_the_stored_dtype(tmp_path):
    cfg = k3.K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, dtype="bfloat16")
    model = randomize_(K3ForCausalLM(cfg))  # fp32 master weights, as training keeps them
    save_pretrained(model, tmp_path / "a")
    assert json.load(open(tmp_path / "a" / "config.json"))["dtype"] == "float32"
    assert from_pretrained(tmp_path / "a").lm_head.weight.dtype == torch.float32
    save_pretrained(model, tmp_path / "b", dtype=torch.bfloat16)
    assert json.load(open(tmp_path / "b" / "config.json"))["dtype"] == "bfloat16"
    assert from_pretrained(tmp_path / "b").lm_head.weight.dtype == torch.bfloat16
