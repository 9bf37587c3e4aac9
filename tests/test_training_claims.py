"""benchmarks/training_claims.py's bookkeeping: a diverged arm is recorded and read back, not rerun, and the study
goes on to the next arm."""

import argparse
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("training_claims", ROOT / "benchmarks" / "training_claims.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_diverged_arm_is_a_result_read_back_not_rerun(tmp_path, monkeypatch):
    from k3.train import run
    from k3.train.trainer import TrainingError

    claims = _load()
    calls = []

    def diverging(opts, tcfg, **kw):  # two logged steps, then the trainer gives up
        calls.append(tcfg.out)
        Path(tcfg.out).mkdir(parents=True, exist_ok=True)
        (Path(tcfg.out) / "tokenizer.json").write_text("{}")
        with open(Path(tcfg.out) / "metrics.jsonl", "w") as f:
            for step in (1, 2):
                f.write(json.dumps({"step": step, "loss": 9.0, "max_logit": 300.0 * step}) + "\n")
        raise TrainingError("5 consecutive non-finite steps")

    monkeypatch.setattr(run, "run_training", diverging)
    args = argparse.Namespace(out=str(tmp_path), steps=10, clip_lr=2e-2, lr=2e-3, seq_len=8, batch_tokens=16,
                              seed=0, eval_batches=1, device="cpu", device_resolved="cpu", preset="tiny", data=None,
                              vocab_size=256)
    recs = claims.run_arm("noclip", args)
    assert [r["step"] for r in recs] == [1, 2]
    assert "non-finite" in (tmp_path / "noclip" / "diverged.txt").read_text()
    row = claims.summarize("noclip", recs, diverged=True)
    assert row["diverged"] is True and row["steps"] == 2 and row["max_logit"] == 600.0
    assert claims.run_arm("noclip", args) == recs and len(calls) == 1  # read back, not rerun
