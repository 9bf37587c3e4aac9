"""`k3 train --backend` / `k3 serve --backend`: one flag for every op's implementation."""

import os

import pytest

from k3 import cli
from k3.ops.backend import FAST, env_var


@pytest.fixture
def clean_env(monkeypatch):
    for op in FAST:  # restored after the test whatever the command sets
        monkeypatch.setenv(env_var(op), "auto")
    return monkeypatch


def test_train_backend_torch_sets_every_op_and_auto_leaves_them(clean_env, tmp_path):
    from k3.train import run

    seen = []
    clean_env.setattr(run, "run_training", lambda opts, tcfg, **kw: seen.append(tcfg) or {"step": 0})
    out = str(tmp_path / "run")
    assert cli.main(["train", "--out", out, "--device", "cpu", "--max-steps", "1"]) == 0
    assert all(os.environ[env_var(op)] == "auto" for op in FAST)
    assert cli.main(["train", "--out", out, "--device", "cpu", "--max-steps", "1", "--backend", "torch"]) == 0
    assert all(os.environ[env_var(op)] == "torch" for op in FAST) and len(seen) == 2


def test_backend_flag_keeps_an_op_pinned_by_its_variable(clean_env, tmp_path):
    from k3.train import run

    clean_env.setattr(run, "run_training", lambda opts, tcfg, **kw: {"step": 0})
    clean_env.setenv("K3_MOE_COMBINE_BACKEND", "triton")
    assert cli.main(["train", "--out", str(tmp_path / "r"), "--device", "cpu", "--max-steps", "1",
                     "--backend", "torch"]) == 0
    assert os.environ["K3_MOE_COMBINE_BACKEND"] == "triton"
    assert all(os.environ[env_var(op)] == "torch" for op in FAST if op != "moe_combine")


def test_backend_fast_without_cuda_is_a_clear_error(clean_env, tmp_path):
    with pytest.raises(SystemExit, match="--backend fast needs a CUDA device"):
        cli.main(["train", "--out", str(tmp_path / "r"), "--device", "cpu", "--max-steps", "1", "--backend", "fast"])
    assert all(os.environ[env_var(op)] == "auto" for op in FAST)  # nothing was changed


def test_serve_parses_backend_and_rejects_unknown_values(capsys):
    parse = cli.build_parser().parse_args
    assert parse(["serve", "--ckpt", "x", "--backend", "torch"]).backend == "torch"
    assert parse(["serve", "--ckpt", "x"]).backend == "auto"
    with pytest.raises(SystemExit):
        parse(["train", "--backend", "turbo"])
    assert "invalid choice: 'turbo'" in capsys.readouterr().err


def test_cli_builds_without_the_http_stack_and_runs_as_a_module():
    # `k3 train` on a machine without FastAPI installed must still start: the serve flags live apart from the server
    import subprocess
    import sys

    code = "import sys; from k3.cli import build_parser; build_parser(); print('fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    help_text = subprocess.run([sys.executable, "-m", "k3", "train", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "--max-minutes" in help_text
