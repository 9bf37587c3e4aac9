import os

import pytest
import torch

from k3.config import K3Config

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # a worker of `pytest -n N` (pytest-xdist): its share of the cores, in this process and in the processes its
    # tests start (torchrun, CLI runs), so that N workers do not each spin a thread per core
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


@pytest.fixture
def tiny_cfg() -> K3Config:
    # fp32, with MTP off unless a test asks for it.
    return K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """Triton's interpreter for the fused decode kernels in an engine test, with the paged MLA attention on its
    reference (its kernel has tests of its own; interpreted, it is most of such a test's time)."""
    import k3.ops.mla_decode

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(k3.ops.mla_decode, "_use_triton", lambda kv: False)
