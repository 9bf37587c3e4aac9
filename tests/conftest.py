import pytest

from k3.config import K3Config


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
