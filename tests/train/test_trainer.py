import json
import os

import numpy as np
import pytest
import torch

from helpers import stop_after
from k3.checkpoint import CheckpointError
from k3.config import K3Config
from k3.data.packing import PackedLoader
from k3.model.model import K3ForCausalLM
from k3.train.trainer import Trainer, TrainConfig, TrainingError


def _cfg():
    return K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0)


def _stream(n=40_000, seed=0):
    # A learnable synthetic stream: a noisy periodic sequence with document breaks (eos = 0).
    rng = np.random.default_rng(seed)
    base = np.tile(np.arange(1, 97, dtype=np.int32), n // 96 + 1)[:n]
    noise = rng.integers(1, 512, size=n, dtype=np.int32)
    s = np.where(rng.random(n) < 0.1, noise, base)
    s[rng.random(n) < 0.01] = 0
    return s.astype(np.int32)


def _trainer(tmp_path, max_steps, seed=0, **kw):
    torch.manual_seed(seed)
    model = K3ForCausalLM(_cfg()).init_weights(seed=seed)
    tc = TrainConfig(out=str(tmp_path), max_steps=max_steps, seq_len=64, batch_tokens=512, lr=3e-3,
                     eval_every=10, eval_batches=2, save_every_minutes=1e9, seed=seed, **kw)
    loader = PackedLoader(_stream(), tc.seq_len, tc.rows_per_step, eos_id=0, seed=seed)
    return Trainer(model, tc, loader, eval_stream=_stream(4000, seed=1), eos_id=0, log=lambda *a: None)


def test_training_reduces_loss_and_logs_everything(tmp_path):
    tr = _trainer(tmp_path, 30)
    summary = tr.fit(progress_bar=False)
    recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert recs[0]["step"] == 0 and "val_loss" in recs[0]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 30
    r = steps[-1]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "max_logit", "clipped_heads", "expert_load_max_over_mean",
                "mtp_loss"):
        assert key in r, key
    assert len(r["expert_load_max_over_mean"]) == _cfg().num_hidden_layers  # 4 MoE layers + the MTP layer
    assert summary["last_val_loss"] < 0.8 * summary["first_val_loss"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert os.path.isdir(summary["checkpoint"])


def test_resume_is_bit_exact(tmp_path):
    straight = _trainer(tmp_path / "a", 20)
    straight.fit(progress_bar=False)
    # The same 20-step run, stopped after step 10 (as Ctrl-C does) and resumed in a fresh trainer.
    first = _trainer(tmp_path / "b", 20)
    stop_after(first, 10)
    assert first.fit(progress_bar=False)["step"] == 10
    resumed = _trainer(tmp_path / "b", 20)
    resumed.load(os.path.join(tmp_path / "b", "checkpoints", "step-0000010"))
    assert resumed.step == 10
    resumed.fit(progress_bar=False)
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    la = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]
    lb = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl")]
    loss_a = [r["loss"] for r in la if "loss" in r]
    loss_b = [r["loss"] for r in lb if "loss" in r]
    assert loss_a == loss_b


def test_resume_after_a_kill_logs_each_step_once(tmp_path):
    """A run killed after its last checkpoint has logged steps past it; the resumed run trains them again and
    metrics.jsonl holds each step once, as the run without the kill does."""
    straight = _trainer(tmp_path / "a", 12)
    straight.fit(progress_bar=False)
    first = _trainer(tmp_path / "b", 12)
    stop_after(first, 6)
    first.fit(progress_bar=False)  # checkpoint at step 6
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # steps 7-9 logged, then killed mid-line
        for r in [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]:
            if r["step"] in (7, 8, 9):
                f.write(json.dumps(r) + "\n")
        f.write('{"step": 10, "lo')
    resumed = _trainer(tmp_path / "b", 12)
    resumed.load(os.path.join(tmp_path / "b", "checkpoints", "step-0000006"))
    resumed.fit(progress_bar=False)
    la = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]
    lb = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in lb] == [r["step"] for r in la]
    assert [r.get("loss") for r in lb] == [r.get("loss") for r in la]
    assert [r.get("val_loss") for r in lb] == [r.get("val_loss") for r in la]


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, 50, max_bad_steps=3)
    tr.fit(progress_bar=False)  # a good checkpoint at step 50
    good = {n: p.clone() for n, p in tr.model.state_dict().items()}
    tr.cfg.max_steps = 60
    orig = tr.model.forward

    def poisoned(*a, **k):
        out = orig(*a, **k)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(tr.model, "forward", poisoned)
    m = tr.train_step()
    assert m.skipped
    for n, p in tr.model.state_dict().items():
        assert torch.equal(p, good[n]), n  # nothing changed, router biases included
    with pytest.raises(TrainingError, match="consecutive"):
        tr.fit(progress_bar=False)
    from k3.checkpoint import from_pretrained

    last = from_pretrained(tmp_path / "checkpoints" / "step-0000050")
    assert torch.equal(last.lm_head.weight, good["lm_head.weight"])


def test_stop_request_saves_and_exits(tmp_path):
    tr = _trainer(tmp_path, 1000)
    orig = tr.train_step

    def step_then_stop():
        m = orig()
        if tr.step == 3:
            tr._stop_requested = True  # what Ctrl-C does
        return m

    tr.train_step = step_then_stop
    summary = tr.fit(progress_bar=False)
    assert summary["interrupted"] and summary["step"] == 3
    assert os.path.isdir(tmp_path / "checkpoints" / "step-0000003")


def test_a_run_without_checkpoints_writes_none_and_logs_the_same_steps(tmp_path):
    # what benchmarks/training_claims.py runs: metrics only (a checkpoint of k3-mini takes ~35 s to write)
    summary = _trainer(tmp_path / "a", 4, save_checkpoints=False).fit(progress_bar=False)
    assert summary["checkpoint"] is None and summary["step"] == 4
    assert not any((tmp_path / "a" / "checkpoints").glob("step-*"))
    _trainer(tmp_path / "b", 4).fit(progress_bar=False)
    a, b = ([json.loads(l) for l in open(tmp_path / d / "metrics.jsonl")] for d in ("a", "b"))
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    with pytest.raises(ValueError, match="save_checkpoints"):
        TrainConfig(max_steps=1, qat="mxfp4", save_checkpoints=False).validate()


def test_corrupted_checkpoint_is_refused(tmp_path):
    tr = _trainer(tmp_path, 2)
    tr.fit(progress_bar=False)
    ck = tmp_path / "checkpoints" / "step-0000002"
    shard = next(p for p in ck.iterdir() if p.name.startswith("model-"))
    shard.write_bytes(shard.read_bytes()[:100])
    fresh = _trainer(tmp_path, 4)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        fresh.load(str(ck))
    (ck / "trainer_state.json").write_text("{broken")
    tr2 = _trainer(tmp_path / "x", 2)
    tr2.fit(progress_bar=False)
    ck2 = tmp_path / "x" / "checkpoints" / "step-0000002"
    (ck2 / "trainer_state.json").write_text("{broken")
    with pytest.raises(TrainingError, match="damaged"):
        _trainer(tmp_path / "x", 4).load(str(ck2))
    tr3 = _trainer(tmp_path / "y", 2)
    tr3.fit(progress_bar=False)
    ck3 = tmp_path / "y" / "checkpoints" / "step-0000002"
    st = ck3 / "trainer_state.safetensors"  # read through a memory map now: a truncated file is still named
    st.write_bytes(st.read_bytes()[:200])
    with pytest.raises(TrainingError, match="damaged"):
        _trainer(tmp_path / "y", 4).load(str(ck3))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=None, max_minutes=None).validate()
    with pytest.raises(ValueError, match="balance"):
        TrainConfig(max_steps=1, balance="magic").validate()
    with pytest.raises(ValueError, match="batch_tokens"):
        TrainConfig(max_steps=1, seq_len=256, batch_tokens=100).validate()


def test_cli_train_resume_eval_generate(tmp_path, capsys):
    from k3.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j} + {i}\n\n" for j in range(300)))
    out = str(tmp_path / "run")
    common = ["train", "--data", str(data), "--out", out, "--seq-len", "64", "--batch-tokens", "512",
              "--vocab-size", "300", "--eval-every", "2", "--no-progress", "--device", "cpu"]
    assert main(common + ["--max-steps", "4"]) == 0
    assert main(common + ["--max-steps", "4"]) == 2  # refuses to overwrite a run without --resume
    assert main(common + ["--max-steps", "6", "--resume"]) == 0
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert main(["eval", "--ckpt", out, "--data", str(data), "--seq-len", "64", "--device", "cpu"]) == 0
    assert main(["generate", "--ckpt", out, "def f", "--max-new-tokens", "5", "--seed", "0", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "held-out loss" in text and "def f" in text


# --- out of memory during a step: the same batch is retried in smaller micro-batches ----------------------

def _oom_above(tr, max_rows):
    """Make the model raise the out-of-memory error on micro-batches of more than `max_rows` rows (after the
    forward has run, as a real allocation failure in the middle of a step would)."""
    real = tr.model.forward
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def forward(input_ids, *a, **kw):
        out = real(input_ids, *a, **kw)
        if input_ids.shape[0] > max_rows:
            raise oom("CUDA out of memory (simulated)")
        return out

    tr.model.forward = forward


def test_oom_halves_the_micro_batch_and_the_step_equals_a_run_with_that_size(tmp_path):
    # 8 rows per step: 8 fails, 4 fails, 2 fits. The trained weights equal a run that used 2 from the start.
    tr = _trainer(tmp_path / "a", 3)
    msgs = []
    tr.log = msgs.append
    _oom_above(tr, 2)
    losses = [tr.train_step().loss for _ in range(3)]
    assert tr.cfg.micro_batch_rows == 2
    assert sum("out of memory" in m for m in msgs) == 2  # 8 -> 4 -> 2, then kept
    ref = _trainer(tmp_path / "b", 3, micro_batch_rows=2)
    ref_losses = [ref.train_step().loss for _ in range(3)]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for (n, p), q in zip(tr.model.named_parameters(), ref.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), n
    for a, b in zip(tr.moe_layers, ref.moe_layers):  # balancing saw each row once, not the failed attempts
        assert torch.allclose(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias, atol=1e-6)


def test_oom_on_one_rank_of_a_distributed_run_stops_instead_of_retrying_alone(tmp_path):
    # A rank that halved its micro-batch alone would issue a different number of collectives than the others: the
    # distributed trainer (retries_oom False) stops with a message naming the way out, the parameters untouched.
    tr = _trainer(tmp_path, 3)
    tr.log = lambda *a: None
    tr.retries_oom = False
    before = [p.detach().clone() for p in tr.model.parameters()]
    _oom_above(tr, 2)
    with pytest.raises(TrainingError, match="one rank of a distributed run.*--micro-batch-rows"):
        tr.train_step()
    assert all(torch.equal(a, p) for a, p in zip(before, tr.model.parameters()))
    assert tr.cfg.micro_batch_rows is None or tr.cfg.micro_batch_rows > 2


def test_oom_with_one_row_stops_with_a_clear_message(tmp_path):
    tr = _trainer(tmp_path, 3)
    tr.log = lambda *a: None
    _oom_above(tr, 0)
    with pytest.raises(TrainingError, match="even with 1-row micro-batches.*--activation-checkpointing"):
        tr.train_step()


def test_balance_diagnostics_log_the_same_batch_ideal_and_change_nothing(tmp_path):
    plain = _trainer(tmp_path / "plain", 3)
    diag = _trainer(tmp_path / "diag", 3, balance_diagnostics=True)
    for _ in range(3):
        a, b = plain.train_step(), diag.train_step()
        assert a.loss == b.loss and a.expert_load_max_over_mean == b.expert_load_max_over_mean
        assert a.expert_load_ideal_max_over_mean is None
        ideal = b.expert_load_ideal_max_over_mean
        assert len(ideal) == len(b.expert_load_max_over_mean) and all(1.0 <= r < 1e3 for r in ideal)
        idle = b.experts_without_tokens
        assert idle == [int((bal.last_load == 0).sum()) for bal in diag.balancers] and a.experts_without_tokens is None
    for p, q in zip(plain.model.parameters(), diag.model.parameters()):
        assert torch.equal(p, q)
    # without balancing the loads are still measured, and the bias stays
    none = _trainer(tmp_path / "none", 2, balance="none", balance_diagnostics=True)
    m = none.train_step()
    assert len(m.expert_load_max_over_mean) == len(ideal) and m.expert_load_ideal_max_over_mean == \
        m.expert_load_max_over_mean
    assert all(torch.equal(l.gate.e_score_correction_bias, torch.zeros_like(l.gate.e_score_correction_bias))
               for l in none.moe_layers)
    assert _trainer(tmp_path / "none2", 1, balance="none").balancers == []


def test_training_commands_exit_3_with_the_reason_when_training_cannot_continue(capsys):
    from k3.cli_args import run_training_command

    def fails():
        raise TrainingError("5 consecutive steps had non-finite loss")

    assert run_training_command("sft", fails) == 3
    assert "k3 sft: 5 consecutive steps had non-finite loss" in capsys.readouterr().err
    assert run_training_command("train", lambda: {"interrupted": True}) == 130
    assert run_training_command("train", lambda: {"interrupted": True, "signal": "SIGTERM"}) == 143
    assert run_training_command("distill", lambda: {}) == 0
