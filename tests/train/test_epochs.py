"""The data plan: tokens per epoch and per step, epochs planned, the warning past 4 epochs (planned, or projected from
the speed of a run bounded by time), and --epochs as a budget beside --max-steps / --max-minutes."""

import numpy as np
import pytest
import torch

from k3 import cli
from k3.config import K3Config
from k3.data.packing import PackedLoader
from k3.model.model import K3ForCausalLM
from k3.train.reporting import EPOCHS_WARNING, plan_messages, projection_messages
from k3.train.trainer import Trainer, TrainConfig


def _trainer(tmp_path, n_tokens=2048, **kw):
    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).init_weights(seed=0)
    tc = TrainConfig(out=str(tmp_path), seq_len=64, batch_tokens=512, eval_every=1000, eval_batches=1,
                     save_every_minutes=1e9, **kw)
    stream = np.random.default_rng(0).integers(1, 512, size=n_tokens).astype(np.int32)  # 32 rows of 64
    logs = []
    return Trainer(model, tc, PackedLoader(stream, 64, tc.rows_per_step, eos_id=0), log=logs.append), logs


def test_plan_and_warning_messages():
    ok = plan_messages(1_000_000, 32_768, 100, None, 10)
    assert ok == ["data: 1,000,000 training tokens per epoch, 32,768 tokens per step (30.5 steps per epoch); "
                  "100 steps planned = 3.28 epochs"]
    many = plan_messages(1_000_000, 32_768, 1000, 10.0, 10)
    assert "32.77 epochs" in many[0] and many[1].startswith("warning: this run repeats its training data 32.8 times")
    timed = plan_messages(1_000_000, 32_768, None, 4.0, 10)
    assert len(timed) == 1 and "--max-minutes 4" in timed[0] and "projected at step 10" in timed[0]
    # The run: 2.45M tokens, 32K tokens per step at ~0.42 s per step for 4 minutes is ~7 epochs.
    proj = projection_messages(2_450_000, 32_768, 10, 4.2, 0.42, 4.0)
    assert "~571 steps = ~7.64 epochs" in proj[0] and len(proj) == 2 and "warning" in proj[1]
    assert len(projection_messages(2_450_000, 32_768, 10, 4.2, 4.2, 4.0)) == 1  # 0.76 epochs: no warning
    assert EPOCHS_WARNING == 4.0


def test_epochs_budget_ends_the_run_and_the_first_budget_wins(tmp_path, one_thread):
    tr, logs = _trainer(tmp_path / "a", epochs=1.5)  # 32 rows, 8 per step: 6 steps
    assert tr.step_budget() == 6
    summary = tr.fit(progress_bar=False)
    assert summary["step"] == 6 and summary["epochs"] == 1.5
    assert tr.loader.state_dict() == {"epoch": 1, "position": 16, "seed": 0}
    assert logs[0] == ("data: 2,048 training tokens per epoch, 512 tokens per step (4.0 steps per epoch); "
                       "6 steps planned = 1.50 epochs")
    assert _trainer(tmp_path / "b", epochs=1.5, max_steps=4)[0].step_budget() == 4
    assert _trainer(tmp_path / "c", epochs=0.01)[0].step_budget() == 1  # at least one step
    assert _trainer(tmp_path / "d", epochs=2.0, max_minutes=5.0)[0].step_budget() == 8  # and the clock too
    with pytest.raises(ValueError, match="'epochs' = -1"):
        TrainConfig(epochs=-1).validate()
    TrainConfig(epochs=2).validate()  # a budget on its own


def test_a_run_that_repeats_its_data_is_warned_before_its_first_step(tmp_path, one_thread):
    tr, logs = _trainer(tmp_path, max_steps=40)  # 10 epochs of 4 steps
    tr._stop_requested = True  # stop before the first step: the plan is printed all the same
    tr.fit(progress_bar=False)
    assert "40 steps planned = 10.00 epochs" in logs[0]
    assert logs[1].startswith("warning: this run repeats its training data 10.0 times (more than 4)")


def test_a_time_bounded_run_projects_its_epochs(tmp_path, one_thread):
    tr, logs = _trainer(tmp_path, max_minutes=60.0)  # an hour of 4-step epochs: warned at step 10
    real = tr.train_step

    def step():
        m = real()
        tr.elapsed = 0.5 * tr.step  # half a second per step, whatever the machine
        if tr.step == 10:
            tr._stop_requested = True
        return m

    tr.train_step = step
    tr.fit(progress_bar=False)
    proj = [l for l in logs if l.startswith("data: at")]
    assert proj == ["data: at 0.5 s per step the 60-minute budget comes to ~7,200 steps = ~1800.00 epochs"]
    assert any(l.startswith("warning: this run repeats its training data 1800.0 times") for l in logs)


def test_cli_epochs_workers_and_data_cache_reach_the_run(tmp_path, monkeypatch):
    from k3.train import run

    seen = []
    monkeypatch.setattr(run, "run_training", lambda opts, tcfg, **kw: seen.append((opts, tcfg)) or {"step": 0})
    out = str(tmp_path / "r")
    assert cli.main(["train", "--out", out, "--device", "cpu", "--epochs", "2.5", "--workers", "3",
                     "--data-cache", str(tmp_path / "cache")]) == 0
    opts, tcfg = seen[0]
    assert tcfg.epochs == 2.5 and tcfg.max_minutes is None and tcfg.max_steps is None  # no default time budget
    assert opts.workers == 3 and opts.data_cache == str(tmp_path / "cache")
    assert cli.main(["train", "--out", out, "--device", "cpu"]) == 0
    assert seen[1][1].max_minutes == 10.0 and seen[1][1].epochs is None


def test_eval_every_defaults_per_device_and_the_flag_wins():
    """A GPU run evaluates every 200 steps by default (an evaluation of the whole held-out set costs ~23 k3-mini
    steps on an H200), a CPU run every 50; --eval-every overrides both."""
    from k3 import cli
    from k3.cli_args import _train_config
    from k3.train.run import CPU_DEFAULTS, GPU_DEFAULTS

    parse = cli.build_parser().parse_args
    assert _train_config(parse(["train", "--out", "x"]), GPU_DEFAULTS).eval_every == 200
    assert _train_config(parse(["train", "--out", "x"]), CPU_DEFAULTS).eval_every == 50
    assert _train_config(parse(["train", "--out", "x", "--eval-every", "7"]), GPU_DEFAULTS).eval_every == 7


def test_the_warning_names_the_commands_data_flag():
    """k3 rl's data are its tasks and k3 distill's its prompts: the warning names the flag that adds them."""
    from k3.posttrain.distill import PromptSource
    from k3.rl.trainer import TaskSource

    assert "add data (--data)" in plan_messages(1_000, 500, 100, None, 10)[1]
    for flag in (TaskSource.data_flag, PromptSource.data_flag):
        assert f"add data ({flag})" in plan_messages(1_000, 500, 100, None, 10, flag)[1]
        assert f"add data ({flag})" in projection_messages(1_000, 500, 10, 4.2, 0.42, 4.0, flag)[1]
    assert (TaskSource.data_flag, PromptSource.data_flag) == ("--tasks", "--prompts")
