"""Backend selection per op (pure logic: no kernel runs here)."""

import os

import pytest
import torch

from k3.ops import backend
from k3.ops.backend import FAST, env_var, resolve

CUDA = torch.device("cuda")  # resolve() only reads the device type; nothing is allocated
CPU = torch.device("cpu")
YES = lambda: (True, "")  # noqa: E731
NO = lambda: (False, "the kernel library is missing")  # noqa: E731


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for op in FAST:  # setenv first so that teardown restores the original state even after force_all
        monkeypatch.setenv(env_var(op), "auto")
        monkeypatch.delenv(env_var(op))
    monkeypatch.setattr(backend, "_notices", set())


def test_auto_uses_the_reference_on_cpu_and_validated_fast_paths_on_cuda(monkeypatch):
    monkeypatch.setattr(backend, "VALIDATED", {op: True for op in FAST})
    for op, fast in FAST.items():
        assert resolve(op, CPU, YES) == "torch"
        assert resolve(op, CUDA, YES) == fast


def test_unvalidated_or_unavailable_fast_paths_fall_back_with_one_notice(monkeypatch, capsys):
    monkeypatch.setattr(backend, "VALIDATED", {**{op: True for op in FAST}, "kda": False})
    assert resolve("kda", CUDA, YES) == "torch"
    assert resolve("kda", CUDA, YES) == "torch"
    assert resolve("moe", CUDA, NO) == "torch"
    err = capsys.readouterr().err
    assert err.count("not yet validated") == 1 and "K3_KDA_BACKEND=fla" in err
    assert "the kernel library is missing" in err


def test_explicit_choices_are_obeyed_or_refused_by_name(monkeypatch):
    monkeypatch.setenv("K3_MLA_BACKEND", "torch")
    assert resolve("mla", CUDA, YES) == "torch"
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")  # forced: runs even though not validated
    monkeypatch.setattr(backend, "VALIDATED", {op: False for op in FAST})
    assert resolve("kda", CUDA, YES) == "fla"
    with pytest.raises(ValueError, match="K3_KDA_BACKEND=fla: the kernel library is missing"):
        resolve("kda", CUDA, NO)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve("kda", CPU, YES)
    monkeypatch.setenv("K3_MOE_BACKEND", "grouped")  # the grouped GEMM also runs on CPU when asked for
    assert resolve("moe", CPU, YES) == "grouped"
    monkeypatch.setenv("K3_ATTN_RES_BACKEND", "turbo")
    with pytest.raises(ValueError, match="K3_ATTN_RES_BACKEND='turbo' is invalid: use auto, torch or fla"):
        resolve("attn_res", CUDA, YES)
    assert resolve("attn_res", CUDA, YES, requested="torch") == "torch"  # an explicit argument wins


def test_importable_names_the_missing_module_and_force_all_sets_every_op(monkeypatch):
    assert backend.importable("json") == (True, "")
    ok, why = backend.importable("fla_missing_module_xyz")
    assert not ok and "fla_missing_module_xyz is not importable" in why and "pip install k3[gpu]" in why
    backend.force_all("fast")
    assert all(resolve(op, CUDA, YES) == fast for op, fast in FAST.items())
    assert os.environ["K3_KDA_HOST_OFFSETS_BACKEND"] == "fla"  # fla's chunk lists from host offsets, a fast op too
    monkeypatch.setenv("K3_MOE_BACKEND", "torch")
    backend.force_all("fast", overwrite=False)  # keeps what is already set
    assert resolve("moe", CUDA, YES) == "torch"
    backend.force_all("torch")
    assert all(resolve(op, CUDA, YES) == "torch" for op in FAST)
    with pytest.raises(ValueError, match="mode must be 'fast' or 'torch'"):
        backend.force_all("auto")
