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
