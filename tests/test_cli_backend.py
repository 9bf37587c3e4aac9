"""`k3 train --backend` / `k3 serve --backend`: one flag for every op's implementation, K3_<OP>_BACKEND for one op."""

import os

import pytest

from k3 import cli
from k3.ops.registry import Backends, ops


@pytest.fixture
def clean_env(monkeypatch):
    for var in list(os.environ):  # restored after the test
        if var.startswith("K3_"):
            monkeypatch.delenv(var)
    return monkeypatch


def test_train_backend_torch_sets_every_op_and_auto_leaves_them(clean_env, tmp_path):
    from k3.train import run

    seen = []
    clean_env.setattr(run, "run_training", lambda opts, tcfg, **kw: seen.append(opts) or {"step": 0})
    out = str(tmp_path / "run")
    assert cli.main(["train", "--out", out, "--device", "cpu", "--max-steps", "1"]) == 0
    assert seen[0].backends == Backends()
    assert all(seen[0].backends.requested(op) == "auto" for op in ops())
    assert cli.main(["train", "--out", out, "--device", "cpu", "--max-steps", "1", "--backend", "torch"]) == 0
    assert all(seen[1].backends.requested(op) == "torch" for op in ops()) and len(seen) == 2


def test_backend_flag_keeps_an_op_pinned_by_its_variable(clean_env, tmp_path):
    from k3.train import run

    seen = []
    clean_env.setattr(run, "run_training", lambda opts, tcfg, **kw: seen.append(opts) or {"step": 0})
    clean_env.setenv("K3_MOE_COMBINE_BACKEND", "triton")
    assert cli.main(["train", "--out", str(tmp_path / "r"), "--device", "cpu", "--max-steps", "1",
                     "--backend", "torch"]) == 0
    b = seen[0].backends
    assert b.requested("moe_combine") == "triton"
    assert all(b.requested(op) == "torch" for op in ops() if op != "moe_combine")


def test_backend_fast_without_cuda_is_a_clear_error(clean_env, tmp_path):
    before = dict(os.environ)
    with pytest.raises(SystemExit, match="--backend fast needs a CUDA device"):
        cli.main(["train", "--out", str(tmp_path / "r"), "--device", "cpu", "--max-steps", "1", "--backend", "fast"])
    assert dict(os.environ) == before  # nothing was changed


def test_a_bad_variable_is_named(clean_env, tmp_path, capsys):
    clean_env.setenv("K3_KDA_BACKEND", "magic")
    assert cli.main(["train", "--out", str(tmp_path / "r"), "--device", "cpu", "--max-steps", "1"]) == 2
    assert "K3_KDA_BACKEND='magic' is invalid: use auto, torch, fla" in capsys.readouterr().err


def test_serve_parses_backend_and_rejects_unknown_values(capsys):
    parse = cli.build_parser().parse_args
    assert parse(["serve", "--ckpt", "x", "--backend", "torch"]).backend == "torch"
    assert parse(["serve", "--ckpt", "x"]).backend == "auto"
    with pytest.raises(SystemExit):
        parse(["train", "--backend", "turbo"])
    assert "invalid choice: 'turbo'" in capsys.readouterr().err


def test_serve_passes_the_backends_and_takes_the_api_key_from_the_environment(clean_env):
    # The engine's model gets the Backends the command line built; K3_API_KEY is --api-key's default.
    from k3.serve import cli as serve_cli

    seen = []
    clean_env.setattr(serve_cli, "cmd_serve", lambda a: seen.append(a) or 0)
    clean_env.setenv("K3_MOE_BACKEND", "torch")
    clean_env.setenv("K3_API_KEY", "from-env")
    parse = cli.build_parser().parse_args
    args = parse(["serve", "--ckpt", "x", "--device", "cpu", "--backend", "torch"])
    assert args.fn(args) == 0
    assert seen[0].backends == Backends(default="torch", per_op={"moe": "torch"}) and seen[0].api_key == "from-env"
    args = parse(["serve", "--ckpt", "x", "--device", "cpu", "--api-key", "flag"])
    assert args.fn(args) == 0 and seen[1].api_key == "flag" and seen[1].backends.default == "auto"


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
