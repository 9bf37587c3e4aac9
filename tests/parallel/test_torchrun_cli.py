"""`k3 train` under torchrun on CPU (gloo): two processes with expert parallelism over both train the same run as one
process does, write a checkpoint that `k3 eval` and the serving engine load, and reach the same held-out loss."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _val_losses(run: str) -> list[float]:
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return [r["val_loss"] for r in recs if "val_loss" in r]


@pytest.mark.slow  # ~25 s on 2 cores (two torchrun launches); faster siblings: one-process torchrun (below) and
# expert parallelism against one process in tests/parallel/test_train_distributed.py
def test_torchrun_ep2_equals_one_process_and_its_checkpoint_loads(tmp_path, capsys):
    from k3.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j} + {i}\n\n" for j in range(300)))
    common = ["train", "--data", str(data), "--seq-len", "64", "--batch-tokens", "512", "--vocab-size", "300",
              "--max-steps", "4", "--eval-every", "2", "--no-progress", "--device", "cpu"]
    dist_run, one_run = str(tmp_path / "dist"), str(tmp_path / "one")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "k3"] + common + ["--out", dist_run, "--ep", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # The same command in one process, with the rows each rank had per forward (4 of the 8): the same gradients.
    assert main(common + ["--out", one_run, "--micro-batch-rows", "4"]) == 0
    got, want = _val_losses(dist_run), _val_losses(one_run)
    assert len(got) == len(want) >= 2
    # fp32 on both sides; expert parallelism sums each token's expert outputs and the gradients in another order
    # (~1e-7 relative), which four optimizer steps grow to ~1e-5 in the weights; a held-out loss of ~5 moves far less.
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)
    assert got[-1] < got[0]  # it learned
    # Its checkpoint is an ordinary one: k3 eval reads it, and so does the serving engine.
    capsys.readouterr()
    assert main(["eval", "--ckpt", dist_run, "--data", str(data), "--seq-len", "64", "--device", "cpu"]) == 0
    assert "held-out loss" in capsys.readouterr().out
    from k3.run_dir import latest_checkpoint
    from k3.serve.build import build_engine
    from k3.serve.sampling import SamplingParams

    engine, tok, _ = build_engine(latest_checkpoint(dist_run), device="cpu", cache_memory_mb=16, cuda_graphs=False)
    seq = engine.generate([tok.encode("def f")], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(seq.output_ids) >= 1


def test_moon_ep_needs_expert_parallelism():
    from k3.cli import main

    try:
        main(["train", "--moon-ep", "--max-steps", "1", "--device", "cpu"])
    except SystemExit as e:
        assert "--moon-ep" in str(e) and "--ep" in str(e)
    else:
        raise AssertionError("--moon-ep without --ep 2 or more was accepted")


@pytest.mark.slow
def test_torchrun_resume_continues_the_run(tmp_path):
    # A QAT run of 2 steps on two expert-parallel processes (--ep 2), resumed under torchrun to 3: the resumed ranks load
    # the sharded training state (k3.parallel.checkpoint) of the latest checkpoint and go on from step 3 (the
    # trainer-level resume at the same and at another world size or --ep is compared number by number in
    # test_train_distributed.py).
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text("".join(f"def g{j}(y):\n    return y - {j} * {i}\n\n" for j in range(300)))
    run = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = ["train", "--data", str(data), "--seq-len", "64", "--batch-tokens", "512", "--vocab-size", "300",
              "--eval-every", "100", "--no-progress", "--device", "cpu", "--out", run, "--ep", "2"]
    for extra in (["--max-steps", "2", "--qat", "mxfp4"], ["--max-steps", "3", "--resume"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "-m", "k3"] + common + extra
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line).get("step") for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [s for s in steps if s] == [1, 2, 3]
    assert "resumed from" in done.stdout + done.stderr
    # the run is MXFP4 quantization-aware (--qat mxfp4, kept by --resume): rank 0 exported the gathered final
    # checkpoint for deployment, and it loads with its routed experts in MXFP4
    from k3.checkpoint import from_pretrained
    from k3.model.mx_experts import expert_formats

    assert "MXFP4 export" in done.stdout + done.stderr
    served = from_pretrained(os.path.join(run, "mxfp4"), packed_experts=True)
    assert expert_formats(served) == ("mxfp4", "mxfp8")


def test_one_process_torchrun_trains_on_the_single_device_path(tmp_path):
    # torchrun with one process trains as `k3 train` does (nothing to shard; FSDP2's one-rank path is avoided), and
    # its checkpoints are the single-process ones.
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text("".join(f"def h{j}(z):\n    return z + {j} * {i}\n\n" for j in range(300)))
    run = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "k3", "train", "--data", str(data), "--seq-len", "64",
           "--batch-tokens", "256", "--vocab-size", "300", "--max-steps", "3", "--eval-every", "100",
           "--no-progress", "--device", "cpu", "--out", run]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from k3.run_dir import latest_checkpoint, sharded_state

    out = done.stdout + done.stderr
    assert "sharded over" not in out and "non-finite" not in out
    assert sharded_state(latest_checkpoint(run)) is None
