"""The rough edges a new user and an outside client hit: a stale tokenizer in --out, a damaged tokenizer.json, bad
flags, a resume past a damaged checkpoint, the start-up of a run (compile cache, time to the first step, the first
evaluation), and what lm-evaluation-harness asks the server."""

import json
import os
import time

import pytest

from k3.cli import main


def _data_dir(path, n=6, salt=""):
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (path / f"m{i}.py").write_text("".join(f"def f{j}{salt}(x):\n    return x * {j} + {i}\n\n" for j in range(300)))
    return str(path)


def _train_argv(data, out, *extra):
    return ["train", "--data", data, "--out", out, "--seq-len", "64", "--batch-tokens", "512", "--vocab-size", "300",
            "--eval-every", "1000", "--no-progress", "--device", "cpu", *extra]


# --- 5: no pause in the QAT export -----------------------------------------------------------------------
def test_qat_export_does_not_sleep(tmp_path, monkeypatch):
    import k3.train.qat as qat
    import k3.train.run as run
    from k3.train.trainer import TrainConfig

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    tcfg = TrainConfig(out=str(tmp_path / "run"), max_steps=1, qat="mxfp4")

    class Done:
        cfg = tcfg

        def fit(self, progress_bar):
            return {"step": 1, "epochs": 0.1, "checkpoint": "ck", "interrupted": False}

    monkeypatch.setattr(run, "build_run", lambda *a, **k: Done())
    monkeypatch.setattr(qat, "export_run", lambda trainer, log: "exported")
    summary = run.run_training(run.RunOptions(), tcfg, progress_bar=False, log=lambda *a: None)
    assert summary["export"] == "exported" and slept == []


# --- 3: an unknown device or an out-of-range hyper-parameter is refused, naming the flag --------------------
@pytest.mark.parametrize("argv, flag", [
    (["train", "--device", "tpu"], "--device"),
    (["eval", "--ckpt", "x", "--device", "tpu"], "--device"),
    (["generate", "--ckpt", "x", "hi", "--device", "tpu"], "--device"),
    (["serve", "--ckpt", "x", "--device", "tpu"], "--device"),
    (["train", "--mtp-weight", "nan"], "--mtp-weight"),
    (["train", "--mtp-weight", "-1"], "--mtp-weight"),
    (["train", "--qk-clip-tau", "-1"], "--qk-clip-tau"),
    (["train", "--qk-clip-tau", "inf"], "--qk-clip-tau"),
    (["train", "--lr", "inf"], "--lr"),
    (["train", "--grad-clip", "nan"], "--grad-clip"),
    (["train", "--max-minutes", "inf"], "--max-minutes"),
    (["serve", "--ckpt", "x", "--port", "70000"], "--port"),
    (["serve", "--ckpt", "x", "--cache-memory-mb", "-5"], "--cache-memory-mb"),
    (["serve", "--ckpt", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_bad_flags_are_refused_at_parse_time_naming_the_flag(argv, flag, capsys):
    from k3.cli import build_parser

    with pytest.raises(SystemExit) as e:  # the parser only: a flag it let through must not start a run here
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {flag}" in err.splitlines()[-1], err


def test_zero_mtp_weight_and_qk_clip_tau_stay_allowed():
    from k3.cli import build_parser

    args = build_parser().parse_args(["train", "--mtp-weight", "0", "--qk-clip-tau", "0", "--device", "cuda:1"])
    assert args.mtp_weight == 0 and args.qk_clip_tau == 0 and args.device == "cuda:1"


def test_an_unknown_device_is_one_line_wherever_it_comes_from():
    from k3.devices import pick_device

    with pytest.raises(ValueError, match="--device 'tpu'"):
        pick_device("tpu")
    assert str(pick_device("CPU")) == "cpu"


@pytest.mark.parametrize("field, value", [("mtp_weight", float("nan")), ("mtp_weight", -1.0), ("qk_clip_tau", -1.0),
                                          ("grad_clip", 0.0), ("save_every_minutes", float("nan")),
                                          ("eval_every", 0), ("eval_batches", 0), ("weight_decay", -0.1)])
def test_train_config_refuses_out_of_range_values(field, value):
    from k3.train.trainer import TrainConfig

    with pytest.raises(ValueError, match=field):
        TrainConfig(max_steps=1, **{field: value}).validate()
