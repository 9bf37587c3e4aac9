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


# --- 2: a damaged tokenizer.json is one line naming it, whichever command reads it ----------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    ck = str(tmp_path_factory.mktemp("ck") / "tiny")
    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", ck]) == 0
    return ck


def _truncate(path, keep=100):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep])


def _one_line_naming(capsys, text):
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and text in err[0] and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("command", ["eval", "generate", "serve"])
def test_a_truncated_tokenizer_is_one_line_naming_it(tiny_ckpt, tmp_path, command, capsys):
    import shutil

    ck = str(tmp_path / "ck")
    shutil.copytree(tiny_ckpt, ck)
    _truncate(os.path.join(ck, "tokenizer.json"))
    argv = {"eval": ["eval", "--ckpt", ck, "--device", "cpu"],
            "generate": ["generate", "--ckpt", ck, "hello", "--device", "cpu"],
            "serve": ["serve", "--ckpt", ck, "--device", "cpu", "--port", "0"]}[command]
    capsys.readouterr()
    assert main(argv) == 2
    line = _one_line_naming(capsys, os.path.join(ck, "tokenizer.json"))
    assert "truncated or corrupt" in line


def test_a_truncated_tokenizer_on_resume_is_one_line_naming_it(tiny_ckpt, tmp_path, capsys):
    import shutil

    from k3.train.state import dumps

    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints", "step-0000001")
    shutil.copytree(tiny_ckpt, ck)
    t, j = dumps({"step": 1, "train_config": {"seq_len": 64}})
    open(os.path.join(ck, "trainer_state.safetensors"), "wb").write(t)
    open(os.path.join(ck, "trainer_state.json"), "wb").write(j)
    _truncate(os.path.join(ck, "tokenizer.json"))
    capsys.readouterr()
    assert main(_train_argv(_data_dir(tmp_path / "data"), out, "--resume", "--max-steps", "2")) == 2
    _one_line_naming(capsys, os.path.join(ck, "tokenizer.json"))


def test_loading_a_damaged_tokenizer_raises_a_value_error_naming_the_file(tmp_path):
    from k3.data.tokenizer import K3Tokenizer, load_any_tokenizer, load_tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "trunc')
    for load in (load_any_tokenizer, load_tokenizer, K3Tokenizer.from_file):
        with pytest.raises(ValueError, match=str(path)):
            load(path)


# --- 1: a tokenizer left in --out is reused only for the same data and size --------------------------------------
def _failing_after_the_tokenizer(data, out):
    """A run that trains its tokenizer and then stops: more tokens per batch than the data holds."""
    return _train_argv(data, out, "--max-steps", "1", "--batch-tokens", str(10**9))


def test_a_tokenizer_left_by_a_failed_run_is_not_reused_for_other_data(tmp_path, capsys):
    out = str(tmp_path / "run")
    tok_path = os.path.join(out, "tokenizer.json")
    assert main(_failing_after_the_tokenizer(_data_dir(tmp_path / "a"), out)) == 2
    first = open(tok_path).read()
    other = tmp_path / "b"
    other.mkdir()
    for i in range(4):
        (other / f"t{i}.txt").write_text(" ".join(f"the quick brown fox {i} jumps over the lazy dog {j}."
                                                  for j in range(400)))
    capsys.readouterr()
    assert main(_failing_after_the_tokenizer(str(other), out)) == 2
    text = capsys.readouterr().out
    assert open(tok_path).read() != first
    assert f"{tok_path} was trained on other data" in text and "training a new one" in text, text
    # the same data again: reused, and the log says so
    assert main(_failing_after_the_tokenizer(str(other), out)) == 2
    assert "reused" in capsys.readouterr().out


def test_cached_tokenizer_checks_size_and_data_fingerprint(tmp_path):
    from k3.data.tokenizer import TOKENIZER_SOURCE, cached_tokenizer

    texts = lambda: ["def f(x):\n    return x + 1\n" * 50]  # noqa: E731
    logs = []
    a = cached_tokenizer(tmp_path, texts, 300, data_fingerprint="A", log=logs.append)
    assert json.load(open(tmp_path / TOKENIZER_SOURCE))["data"] == "A" and logs == []
    assert cached_tokenizer(tmp_path, lambda: pytest.fail("trained again"), 300, data_fingerprint="A").to_str() \
        == a.to_str()
    cached_tokenizer(tmp_path, texts, 300, data_fingerprint="B", log=logs.append)
    assert len(logs) == 1 and "other data" in logs[0]
    cached_tokenizer(tmp_path, texts, 320, data_fingerprint="B", log=logs.append)
    assert len(logs) == 2 and "300 tokens, not 320" in logs[1]
    os.remove(tmp_path / TOKENIZER_SOURCE)  # one written before fingerprints were kept: not trusted
    cached_tokenizer(tmp_path, texts, 320, data_fingerprint="B", log=logs.append)
    assert len(logs) == 3 and "no record of the data" in logs[2]
