"""A training run survives what happens to real runs: a second `k3 train` on the same directory, SIGTERM from a
supervisor, SIGKILL in the middle of a save, a crash between the checkpoint's rename and latest.json."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from k3.cli import main
from k3.data.packing import PackedLoader
from k3.model.model import K3ForCausalLM
from k3.run_dir import COMPLETE_FILES, RunLockedError, clean_interrupted, latest_checkpoint, lock_run_dir, prune
from k3.train.trainer import Trainer, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stream(n=40_000, seed=0):
    rng = np.random.default_rng(seed)
    base = np.tile(np.arange(1, 97, dtype=np.int32), n // 96 + 1)[:n]
    s = np.where(rng.random(n) < 0.1, rng.integers(1, 512, size=n, dtype=np.int32), base)
    s[rng.random(n) < 0.01] = 0
    return s.astype(np.int32)


def _trainer(out, max_steps, log=None, **kw):
    from k3.config import K3Config

    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0)
    model = K3ForCausalLM(cfg).init_weights(seed=0)
    tc = TrainConfig(out=str(out), max_steps=max_steps, seq_len=64, batch_tokens=512, eval_every=1000,
                     eval_batches=1, save_every_minutes=1e9, **kw)
    loader = PackedLoader(_stream(), tc.seq_len, tc.rows_per_step, eos_id=0, seed=0)
    return Trainer(model, tc, loader, eval_stream=None, eos_id=0, log=log or (lambda *a: None))


def _complete(out) -> list[int]:
    from k3.run_dir import complete_checkpoints

    return [s for s, _ in complete_checkpoints(os.path.join(out, "checkpoints"))]


def _latest_json(out) -> str:
    return json.load(open(os.path.join(out, "checkpoints", "latest.json")))["checkpoint"]


def _data_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j} + {i}\n\n" for j in range(300)))
    return str(data)


def _cli_train(tmp_path, out):
    return ["train", "--data", _data_dir(tmp_path) if not (tmp_path / "data").exists() else str(tmp_path / "data"),
            "--out", out, "--seq-len", "64", "--batch-tokens", "512", "--vocab-size", "300", "--eval-every", "1000",
            "--no-progress", "--device", "cpu"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


# --- one process per run directory -------------------------------------------------------------------------
def test_a_second_lock_fails_naming_the_holder_and_closing_releases(tmp_path):
    out = str(tmp_path / "run")
    held = lock_run_dir(out)
    with pytest.raises(RunLockedError) as e:
        lock_run_dir(out)  # another open file description: flock conflicts even within one process
    assert f"pid {os.getpid()}" in str(e.value) and out in str(e.value)
    assert json.load(open(os.path.join(out, ".lock")))["pid"] == os.getpid()
    held.close()
    lock_run_dir(out).close()


_HOLD = """
import sys
from k3.run_dir import lock_run_dir
f = lock_run_dir(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_train_refuses_a_directory_another_process_trains_in_and_a_killed_holder_releases_it(tmp_path, capsys):
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, out], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        capsys.readouterr()
        assert main(_cli_train(tmp_path, out) + ["--max-steps", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("k3 train: ")
        assert f"pid {holder.pid}" in err[0] and out in err[0]
        assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # refused before doing anything
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            _trainer(out, 1).fit(progress_bar=False)  # the API holds the lock too
        assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
    finally:
        holder.kill()  # SIGKILL: no chance to clean up, the kernel drops the lock
        holder.wait()
    lock_run_dir(out).close()


# --- SIGTERM ------------------------------------------------------------------------------------------------
def test_sigterm_finishes_the_step_saves_exits_143_and_resume_continues(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = _cli_train(tmp_path, out)
    log = open(tmp_path / "train.log", "w")
    env = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}  # a log file as a user's shell gives it
    proc = subprocess.Popen([sys.executable, "-m", "k3"] + argv + ["--max-steps", "100000"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 900  # only a guard against a hung child; nothing here is timed
    try:
        while not (os.path.exists(metrics) and '"loss"' in open(metrics).read()):
            assert proc.poll() is None, open(tmp_path / "train.log").read()
            assert time.monotonic() < deadline, "no training step recorded"
            time.sleep(0.2)
        # the log is written as it goes (a block-buffered stdout would hold these lines until exit)
        assert "model: " in open(tmp_path / "train.log").read()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = open(tmp_path / "train.log").read()
    assert rc == 143, text
    assert "SIGTERM: finishing this step, saving a checkpoint" in text
    steps = [json.loads(line)["step"] for line in open(metrics) if '"loss"' in line]
    last = steps[-1]
    ck = latest_checkpoint(out)
    assert os.path.basename(ck) == f"step-{last:07d}" and _latest_json(out) == os.path.basename(ck)
    from k3.checkpoint import from_pretrained
    from k3.train.state import unflatten

    assert from_pretrained(ck).config.vocab_size >= 300
    assert unflatten(None, json.load(open(os.path.join(ck, "trainer_state.json"))))["step"] == last
    assert main(argv + ["--resume", "--max-steps", str(last + 2)]) == 0
    steps = [json.loads(line)["step"] for line in open(metrics) if '"loss"' in line]
    assert steps == list(range(1, last + 3))


def _signal_during_step(tr, at_step, signals):
    orig = tr.train_step

    def step():
        if tr.step + 1 == at_step:  # in the middle of the step: it must still complete
            for s in signals:
                os.kill(os.getpid(), s)
        return orig()

    tr.train_step = step


def test_sigterm_in_process_saves_the_finished_step_and_restores_the_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    tr = _trainer(tmp_path, 1000)
    _signal_during_step(tr, 2, [signal.SIGTERM])
    summary = tr.fit(progress_bar=False)
    assert summary["interrupted"] and summary["signal"] == "SIGTERM" and summary["step"] == 2
    assert _complete(tmp_path) == [2]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_one_request_delivered_twice_still_saves(tmp_path, sig):
    # `timeout` signals the process and then its process group: the same request arrives twice, back to back
    tr = _trainer(tmp_path, 1000)
    _signal_during_step(tr, 2, [sig, sig])
    summary = tr.fit(progress_bar=False)
    assert summary["interrupted"] and summary["step"] == 2
    assert _complete(tmp_path) == [2]


@pytest.mark.parametrize("sig, exc", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)])
def test_a_second_signal_aborts_without_saving(tmp_path, sig, exc, monkeypatch):
    import k3.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "SIGNAL_REPEAT_S", 0.0)  # the second one counts as a second request at once
    before = signal.getsignal(sig)
    tr = _trainer(tmp_path, 1000)
    _signal_during_step(tr, 2, [sig, sig])
    with pytest.raises(exc) as e:
        tr.fit(progress_bar=False)
    if exc is SystemExit:
        assert e.value.code == 143
    assert _complete(tmp_path) == []
    assert signal.getsignal(sig) is before


# --- crashes around a save: leftovers, retention, resume ----------------------------------------------------
def _fake_checkpoint(path):
    os.makedirs(path)
    for f in COMPLETE_FILES:
        open(os.path.join(path, f), "w").close()


def test_latest_checkpoint_is_the_newest_complete_one_whatever_latest_json_says(tmp_path):
    out, ckdir = str(tmp_path), str(tmp_path / "checkpoints")
    assert latest_checkpoint(out) is None
    _fake_checkpoint(os.path.join(ckdir, "step-0000001"))
    _fake_checkpoint(os.path.join(ckdir, "step-0000002"))
    os.makedirs(os.path.join(ckdir, "step-0000003"))  # incomplete (no files): never chosen
    _fake_checkpoint(os.path.join(ckdir, "step-0000004.partial"))
    newest = os.path.join(ckdir, "step-0000002")
    latest = os.path.join(ckdir, "latest.json")
    assert latest_checkpoint(out) == newest  # latest.json missing
    for content in ["{broken", "[]", '{"checkpoint": 5}', '{"checkpoint": "step-0000009"}',
                    '{"checkpoint": "step-0000001", "step": 1}']:  # the last: a crash before its update
        with open(latest, "w") as f:
            f.write(content)
        assert latest_checkpoint(out) == newest, content
    from k3.cli import _resolve_ckpt

    assert _resolve_ckpt(out) == newest


def test_prune_keeps_exactly_the_newest_up_to_the_current_one(tmp_path):
    ckdir = str(tmp_path)
    for s in range(1, 6):
        _fake_checkpoint(os.path.join(ckdir, f"step-{s:07d}"))
    msgs = []
    # step 3 was just saved by a run continued from step 2: 4 and 5 belong to the abandoned continuation
    prune(ckdir, "step-0000003", keep=2, log=msgs.append)
    assert sorted(os.listdir(ckdir)) == ["step-0000002", "step-0000003"]
    assert len(msgs) == 1 and "step-0000004, step-0000005" in msgs[0]


def test_crash_between_rename_and_latest_json_resumes_from_the_newest(tmp_path, monkeypatch):
    import k3.train.checkpointing as checkpointing_mod

    tr = _trainer(tmp_path, 100, keep_checkpoints=2)
    for _ in range(3):
        tr.train_step()
        tr.save()
    assert _complete(tmp_path) == [2, 3] and _latest_json(tmp_path) == "step-0000003"

    def killed(*a, **k):
        raise OSError("killed")

    monkeypatch.setattr(checkpointing_mod, "atomic_write_text", killed)  # step-4 renamed into place, then the crash
    tr.train_step()
    with pytest.raises(OSError, match="killed"):
        tr.save()
    monkeypatch.undo()
    assert _complete(tmp_path) == [2, 3, 4] and _latest_json(tmp_path) == "step-0000003"

    ck = latest_checkpoint(str(tmp_path))
    assert os.path.basename(ck) == "step-0000004"
    resumed = _trainer(tmp_path, 5, keep_checkpoints=2)
    resumed.load(ck)
    assert resumed.step == 4
    for (n, a), b in zip(tr.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), n
    resumed.fit(progress_bar=False)
    assert _complete(tmp_path) == [4, 5] and _latest_json(tmp_path) == "step-0000005"


_KILL_MID_SAVE = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import k3.checkpoint
from test_run_robustness import _trainer
tr = _trainer(sys.argv[1], 100, keep_checkpoints=2)
for _ in range(2):
    tr.train_step()
    tr.save()
tr.train_step()
# SIGKILL at the moment the finished step-3.partial would be renamed into place: no cleanup code runs
k3.checkpoint.replace_dir = lambda new, path: os.kill(os.getpid(), signal.SIGKILL)
tr.save()
"""


def test_sigkill_in_the_middle_of_a_save_leaves_nothing_behind_after_the_next_start(tmp_path):
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-c", _KILL_MID_SAVE, out, os.path.dirname(__file__)], env=_env(),
                       capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ckdir = os.path.join(out, "checkpoints")
    assert os.path.isdir(os.path.join(ckdir, "step-0000003.partial"))
    assert _complete(out) == [1, 2] and _latest_json(out) == "step-0000002"
    # what else a kill can leave: a prune's half-removed folder and a temporary file of latest.json
    os.makedirs(os.path.join(ckdir, "step-0000001.old"))
    open(os.path.join(ckdir, ".tmp-abc-latest.json"), "w").close()

    msgs = []
    tr = _trainer(out, 4, log=msgs.append, keep_checkpoints=2)
    tr.load(latest_checkpoint(out))
    assert tr.step == 2
    tr.fit(progress_bar=False)
    removed = [m for m in msgs if "left by an interrupted save" in m]
    assert len(removed) == 1
    for name in (".tmp-abc-latest.json", "step-0000001.old", "step-0000003.partial"):
        assert name in removed[0]
    assert sorted(os.listdir(ckdir)) == ["latest.json", "step-0000002", "step-0000004"]  # fit saves at its end
    assert _latest_json(out) == "step-0000004"


def test_a_swap_killed_halfway_restores_the_previous_version(tmp_path):
    # k3.files.replace_dir re-saving step 2: step-2 moved to step-2.old, the kill before step-2.partial moved in
    ckdir = str(tmp_path)
    _fake_checkpoint(os.path.join(ckdir, "step-0000002.old"))
    _fake_checkpoint(os.path.join(ckdir, "step-0000002.partial"))
    msgs = []
    assert clean_interrupted(ckdir, log=msgs.append) == ["step-0000002.partial"]
    assert sorted(os.listdir(ckdir)) == ["step-0000002"]
    assert any("restored step-0000002.old" in m for m in msgs)


def test_cli_resume_after_a_crash_recovers_retention_and_the_newest_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = _cli_train(tmp_path, out)
    assert main(argv + ["--max-steps", "3", "--save-every-minutes", "1e-9"]) == 0  # a checkpoint every step
    assert _complete(out) == [2, 3]
    ckdir = os.path.join(out, "checkpoints")
    # The state a kill leaves: step-3 renamed in but latest.json still naming step-2, the prune not run (one
    # checkpoint too many), and the next save's folder half written.
    with open(os.path.join(ckdir, "latest.json"), "w") as f:
        json.dump({"checkpoint": "step-0000002", "step": 2}, f)
    shutil.copytree(os.path.join(ckdir, "step-0000002"), os.path.join(ckdir, "step-0000001"))
    os.makedirs(os.path.join(ckdir, "step-0000004.partial"))
    capsys.readouterr()
    assert main(argv + ["--resume", "--max-steps", "5"]) == 0
    text = capsys.readouterr().out
    assert "removed step-0000004.partial left by an interrupted save" in text
    assert f"resumed from {os.path.join(ckdir, 'step-0000003')} at step 3" in text
    assert _complete(out) == [4, 5] and _latest_json(out) == "step-0000005"
    assert sorted(os.listdir(ckdir)) == ["latest.json", "step-0000004", "step-0000005"]
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5]


def test_keep_checkpoints_flag_sets_the_retention(tmp_path):
    out = str(tmp_path / "run")
    assert main(_cli_train(tmp_path, out) + ["--max-steps", "3", "--save-every-minutes", "1e-9",
                                             "--keep-checkpoints", "1"]) == 0
    assert _complete(out) == [3]
    with pytest.raises(SystemExit):
        main(["train", "--keep-checkpoints", "0"])


def test_damaged_trainer_state_on_resume_is_one_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    _fake_checkpoint(os.path.join(out, "checkpoints", "step-0000001"))
    with open(os.path.join(out, "checkpoints", "step-0000001", "trainer_state.json"), "w") as f:
        f.write("{broken")
    capsys.readouterr()
    assert main(_cli_train(tmp_path, out) + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3 train: ") and "trainer_state.json is unreadable" in err[0], err


def test_malformed_config_on_resume_is_one_line(tmp_path, capsys):
    from k3.train.state import dumps

    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints", "step-0000001")
    _fake_checkpoint(ck)
    t, j = dumps({"step": 1, "train_config": {"seq_len": 64}})
    open(os.path.join(ck, "trainer_state.safetensors"), "wb").write(t)
    open(os.path.join(ck, "trainer_state.json"), "wb").write(j)
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump({"text_config": {"hidden_size": "big"}}, f)
    capsys.readouterr()
    assert main(_cli_train(tmp_path, out) + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3 train: ") and os.path.join(ck, "config.json") in err[0], err


def test_clean_interrupted_moves_a_staged_sharded_state_into_its_checkpoint(tmp_path):
    from k3.run_dir import SHARDED_FILES, sharded_state

    ckdir = tmp_path / "checkpoints"
    done, orphan = ckdir / "step-0000002", ckdir / "step-0000003.sharded"
    done.mkdir(parents=True)
    for f in COMPLETE_FILES:
        (done / f).write_text("{}")
    for staged in (ckdir / "step-0000002.sharded", orphan):  # killed before the move / before step-3 existed
        staged.mkdir()
        for f in SHARDED_FILES:
            (staged / f).write_text("{}")
    assert sharded_state(str(done)) is None
    clean_interrupted(str(ckdir), log=lambda *a: None)
    assert sharded_state(str(done)) == str(done / "sharded")
    assert sorted(p.name for p in ckdir.iterdir()) == ["step-0000002"]
