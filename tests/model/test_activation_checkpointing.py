"""Activation checkpointing: same loss and gradients, far fewer saved activations, inference paths untouched."""

import json
import os

import numpy as np
import pytest
import torch

import k3.model.block as block
from helpers import one_torch_thread, randomize_, rel_err
from k3.data.packing import PackedLoader
from k3.model.model import K3ForCausalLM
from k3.model.stats import STATS
from k3.train.qk_clip import MaxLogitTracker, qk_clip_
from k3.train.trainer import Trainer, TrainConfig


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matrices gain nothing from intra-op threads, and on a busy machine a thread pool can stall.
    with one_torch_thread():
        yield


def make(cfg, on, seed=0):
    return randomize_(K3ForCausalLM(cfg), seed=seed).train().set_activation_checkpointing(on)


def packed_batch(cfg, B=2, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, 17:] = 1  # row 0: two documents, row 1: three
    seg[1, 9:] = 1
    seg[1, 30:] = 2
    labels = ids.clone()
    labels[0, 17] = -100
    return ids, seg, labels


class CheckpointSpy:
    """Counts the checkpoint calls made by the decoder layers and notes their tensor inputs."""

    def __init__(self, monkeypatch, note=lambda t: None):
        self.calls, self.note = 0, note
        orig = block.checkpoint

        def spy(fn, *args, **kwargs):
            self.calls += 1
            for a in args:
                if isinstance(a, torch.Tensor):
                    self.note(a)
            return orig(fn, *args, **kwargs)

        monkeypatch.setattr(block, "checkpoint", spy)


def test_tiny_covers_every_sublayer_kind(tiny_cfg):
    layers = K3ForCausalLM(tiny_cfg.replace(num_nextn_predict_layers=1)).model.layers
    assert {layer.is_kda for layer in layers} == {True, False}  # KDA and Gated MLA
    assert {hasattr(layer, "block_sparse_moe") for layer in layers} == {True, False}  # LatentMoE and dense MLP


def test_loss_gradients_and_recorded_stats_match(tiny_cfg, monkeypatch):
    cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    ids, seg, labels = packed_batch(cfg)
    runs = {}
    for on in (False, True):
        spy = CheckpointSpy(monkeypatch)
        model = make(cfg, on)
        out = model(ids, labels=labels, segment_ids=seg, stats=STATS)
        (out.loss + 0.3 * out.mtp_loss).backward()
        # 2 sites per layer, backbone and MTP, only when on.
        assert spy.calls == (2 * (cfg.num_hidden_layers + 1) if on else 0)
        runs[on] = model, out
    (ref, out_ref), (ck, out_ck) = runs[False], runs[True]
    assert out_ck.mtp_loss is not None and float(out_ck.mtp_loss.detach()) > 0
    assert rel_err(out_ck.loss, out_ref.loss) < 1e-6
    assert rel_err(out_ck.mtp_loss, out_ref.mtp_loss) < 1e-6
    n = 0
    for (name, p), (_, q) in zip(ref.named_parameters(), ck.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert rel_err(q.grad, p.grad) < 1e-6, name
            n += 1
    assert n > 100
    # What load balancing and QK-Clip read after backward: the statistics of the original forward.
    moe = [(out_ref.stats.routing[i], out_ck.stats.routing[i]) for i in out_ref.stats.routing]
    assert len(moe) == 5 and out_ck.stats.routing.keys() == out_ref.stats.routing.keys()  # 4 MoE layers + MTP
    for a, b in moe:
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert out_ck.stats.max_logit.keys() == out_ref.stats.max_logit.keys()
    for i, a in out_ref.stats.max_logit.items():
        assert torch.allclose(a, out_ck.stats.max_logit[i], rtol=1e-6, atol=0)
    trackers = {}
    for name, model, out in (("ref", ref, out_ref), ("ck", ck, out_ck)):
        trackers[name] = MaxLogitTracker(model)
        trackers[name].observe(out.stats)
    clip_ref, clip_ck = qk_clip_(ref, trackers["ref"], tau=1e9), qk_clip_(ck, trackers["ck"], tau=1e9)
    assert clip_ck["per_layer"].keys() == clip_ref["per_layer"].keys() and len(clip_ck["per_layer"]) == 3
    for k, v in clip_ref["per_layer"].items():
        assert torch.allclose(clip_ck["per_layer"][k], v, rtol=1e-6, atol=0)


def test_statistics_are_the_forwards_and_the_recompute_leaves_them_alone(tiny_cfg, monkeypatch):
    # The layers return their statistics from the checkpointed function: the recompute in backward runs the layers
    # again, but what the forward returned is neither replaced nor modified.
    from k3.model.gated_mla import GatedMLA

    cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    ids, seg, labels = packed_batch(cfg, seed=1)
    spy = CheckpointSpy(monkeypatch)
    model = make(cfg, True)
    calls = []
    for m in model.modules():
        if isinstance(m, GatedMLA):
            m.register_forward_pre_hook(lambda mod, args: calls.append(mod.layer_idx))
    out = model(ids, labels=labels, segment_ids=seg, stats=STATS)
    assert spy.calls == 2 * (cfg.num_hidden_layers + 1) and len(calls) == 3
    routing, top = dict(out.stats.routing), dict(out.stats.max_logit)
    values = ({i: [t.clone() for t in r] for i, r in routing.items()}, {i: t.clone() for i, t in top.items()})
    assert all(not t.requires_grad for r in routing.values() for t in r) and not any(t.requires_grad
                                                                                     for t in top.values())
    (out.loss + 0.3 * out.mtp_loss).backward()
    assert len(calls) > 3  # the MLA layers ran again in backward
    assert out.stats.routing.keys() == routing.keys() and out.stats.max_logit.keys() == top.keys()
    for i, r in routing.items():
        assert out.stats.routing[i] is r and all(torch.equal(t, v) for t, v in zip(r, values[0][i]))
    for i, t in top.items():
        assert out.stats.max_logit[i] is t and torch.equal(t, values[1][i])
    # and they are the statistics of the plain (not checkpointed) forward
    plain = make(cfg, False)(ids, labels=labels, segment_ids=seg, stats=STATS).stats
    for i, r in routing.items():
        assert all(torch.equal(t, v) for t, v in zip(r, plain.routing[i]))
    for i, t in top.items():
        assert torch.allclose(t, plain.max_logit[i], rtol=1e-6, atol=0)


def _saved_bytes(model, ids, seg, labels, monkeypatch) -> tuple[int, int]:
    """Bytes of the distinct activation storages kept for backward: tensors saved by autograd outside checkpointed
    regions plus the inputs each checkpoint holds for its recompute (parameters and buffers excluded)."""
    fixed = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    kept = {}

    def note(t):
        st = t.untyped_storage()
        if st.data_ptr() not in fixed:
            kept[st.data_ptr()] = st.nbytes()
        return t

    spy = CheckpointSpy(monkeypatch, note)
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        out = model(ids, labels=labels, segment_ids=seg)
        loss = out.loss + 0.3 * out.mtp_loss
    loss.backward()  # everything counted is alive until here, so storage addresses are not reused
    return sum(kept.values()), spy.calls


def test_saves_far_fewer_activation_bytes(tiny_cfg, monkeypatch):
    cfg = tiny_cfg.replace(num_nextn_predict_layers=1, vocab_size=256)  # the logits do not dominate
    ids, seg, labels = packed_batch(cfg, T=64)
    plain, n_plain = _saved_bytes(make(cfg, False), ids, seg, labels, monkeypatch)
    ckpt, n_ckpt = _saved_bytes(make(cfg, True), ids, seg, labels, monkeypatch)
    assert n_plain == 0 and n_ckpt == 12
    assert plain > 8 * ckpt, (plain, ckpt)  # measured ~15x on this config


def test_inference_paths_bypass_checkpointing(tiny_cfg, monkeypatch):
    cfg = tiny_cfg.replace(num_nextn_predict_layers=1)
    spy = CheckpointSpy(monkeypatch)
    ref, ck = make(cfg, False), make(cfg, True)
    ids, seg, _ = packed_batch(cfg)
    with torch.no_grad():
        for mode in ("eval", "train"):  # eval mode, and training mode without gradients
            ref.train(mode == "train")
            ck.train(mode == "train")
            assert torch.equal(ck(ids, segment_ids=seg).logits, ref(ids, segment_ids=seg).logits)
    ref.train()
    ck.train()
    # Training mode with gradients enabled, but a decode cache: the inference path.
    logits = []
    for model in (ref, ck):
        cache = model.new_cache()
        parts = [model(ids[:, :20], cache=cache).logits] + [model(ids[:, t:t + 1], cache=cache).logits
                                                            for t in range(20, 24)]
        logits.append(torch.cat(parts, 1))
    assert torch.equal(logits[1], logits[0])
    # Two-phase AttnRes (the inference form) in training mode with gradients.
    ref.model.two_phase_attn_res = ck.model.two_phase_attn_res = True
    assert torch.equal(ck(ids).logits, ref(ids).logits)
    assert spy.calls == 0
    ck.model.two_phase_attn_res = False
    ck(ids)
    assert spy.calls == 2 * cfg.num_hidden_layers


def test_switch_reaches_every_layer(tiny_cfg):
    model = K3ForCausalLM(tiny_cfg.replace(num_nextn_predict_layers=1))
    layers = [m for m in model.modules() if isinstance(m, block.DecoderLayer)]
    assert len(layers) == tiny_cfg.num_hidden_layers + 1
    assert not model.model.activation_checkpointing and not any(m.activation_checkpointing for m in layers)
    assert model.set_activation_checkpointing() is model
    assert model.model.activation_checkpointing and all(m.activation_checkpointing for m in layers)
    model.set_activation_checkpointing(False)
    assert not model.model.activation_checkpointing and not any(m.activation_checkpointing for m in layers)
    model.model.activation_checkpointing = True  # the backbone-level switch
    assert all(m.activation_checkpointing for m in model.model.layers)
    assert not any(k.endswith("activation_checkpointing") for k in model.state_dict())


# --- trainer and CLI ---------------------------------------------------------------------------------------------

def _trainer(tmp_path, on, steps=2):
    from k3.config import K3Config

    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).init_weights(seed=0)
    tc = TrainConfig(out=str(tmp_path), max_steps=steps, seq_len=32, batch_tokens=256, micro_batch_rows=4,
                     eval_every=100, eval_batches=1, save_every_minutes=1e9, activation_checkpointing=on)
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 512, size=8000).astype(np.int32)
    loader = PackedLoader(stream, tc.seq_len, tc.rows_per_step, eos_id=0, seed=0)
    return Trainer(model, tc, loader, eos_id=0, log=lambda *a: None)


def test_trainer_steps_match_and_setting_is_saved(tmp_path):
    hist = {}
    for on in (False, True):
        tr = _trainer(tmp_path / str(on), on)
        assert tr.model.model.activation_checkpointing is on
        hist[on] = [tr.train_step() for _ in range(2)]
        tr.save()
        with open(os.path.join(tmp_path / str(on), "checkpoints", "step-0000002", "trainer_state.json"), "rb") as f:
            from k3.train.state import unflatten

            assert unflatten(None, json.load(f))["train_config"]["activation_checkpointing"] is on
    for a, b in zip(hist[False], hist[True]):
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        assert b.mtp_loss == pytest.approx(a.mtp_loss, rel=1e-6)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
        assert b.max_logit == pytest.approx(a.max_logit, rel=1e-6)
        assert b.expert_load_max_over_mean == pytest.approx(a.expert_load_max_over_mean, rel=1e-6)


def test_train_config_validates_the_flag():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainConfig(max_steps=1, activation_checkpointing="yes").validate()
    TrainConfig(max_steps=1, activation_checkpointing=True).validate()


def test_cli_flag_parses_and_resume_keeps_the_setting(tmp_path, monkeypatch):
    from k3 import cli
    from k3.train import run, state

    parse = cli.build_parser().parse_args
    assert parse(["train", "--activation-checkpointing"]).activation_checkpointing is True
    assert parse(["train", "--no-activation-checkpointing"]).activation_checkpointing is False
    assert parse(["train"]).activation_checkpointing is None

    seen = []
    monkeypatch.setattr(run, "run_training", lambda opts, tcfg, **kw: seen.append(tcfg) or {"step": 0})
    out = str(tmp_path / "run")
    assert cli.main(["train", "--out", out, "--device", "cpu", "--max-steps", "1", "--activation-checkpointing"]) == 0
    assert cli.main(["train", "--out", out, "--device", "cpu", "--max-steps", "1"]) == 0
    assert [t.activation_checkpointing for t in seen] == [True, False]
    # --resume takes the setting from the run's saved trainer state unless a flag overrides it.
    ck = os.path.join(out, "checkpoints", "step-0000001")
    os.makedirs(ck)
    _, j = state.dumps({"train_config": {"max_steps": 1, "activation_checkpointing": True}})
    with open(os.path.join(ck, "trainer_state.json"), "wb") as f:
        f.write(j)
    for name in ("config.json", "model.safetensors.index.json", "trainer_state.safetensors"):  # a complete checkpoint
        open(os.path.join(ck, name), "wb").close()
    with open(os.path.join(out, "checkpoints", "latest.json"), "w") as f:
        json.dump({"checkpoint": "step-0000001", "step": 1}, f)
    assert cli.main(["train", "--out", out, "--device", "cpu", "--resume"]) == 0
    assert cli.main(["train", "--out", out, "--device", "cpu", "--resume", "--no-activation-checkpointing"]) == 0
    assert [t.activation_checkpointing for t in seen[2:]] == [True, False]
