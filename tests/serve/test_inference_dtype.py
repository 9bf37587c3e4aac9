"""The dtype a checkpoint is generated from: float32 checkpoints (every trained one) run in bfloat16 on CUDA, where
the serving cache, the grouped expert GEMMs and the CUDA graphs are bfloat16; the stored dtype elsewhere. `k3 serve`
(build_engine) and `k3 generate` load in it; `k3 eval` keeps the stored dtype."""

import pytest
import torch

from k3 import cli
from k3.serve.build import inference_dtype
from k3.model.model import K3ForCausalLM
from k3.config import K3Config
from k3.checkpoint import save_pretrained

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_inference_dtype():
    assert inference_dtype(torch.float32, CUDA) == torch.bfloat16
    assert inference_dtype(torch.float32, CPU) == torch.float32
    assert inference_dtype(torch.bfloat16, CUDA) == torch.bfloat16
    assert inference_dtype(torch.bfloat16, CPU) == torch.bfloat16


class Loaded(Exception):
    pass


@pytest.fixture
def fp32_ckpt(tmp_path):
    from k3.data.tokenizer import byte_level_tokenizer

    path = str(tmp_path / "ck")
    cfg = K3Config.from_preset("tiny")
    save_pretrained(K3ForCausalLM(cfg), path)
    byte_level_tokenizer(cfg.vocab_size).save(f"{path}/tokenizer.json")
    return path


def _record_loads(monkeypatch, device):
    """from_pretrained replaced by one that records its dtype and stops; pick_device answering `device`."""
    import k3.checkpoint
    import k3.devices

    seen = []

    def fake(path, dtype=None, device=None, **kw):
        seen.append(dtype)
        raise Loaded

    monkeypatch.setattr(k3.checkpoint, "from_pretrained", fake)
    monkeypatch.setattr(k3.devices, "pick_device", lambda spec: device)
    return seen


@pytest.mark.parametrize("device, want", [(CUDA, torch.bfloat16), (CPU, torch.float32)])
def test_serving_and_generation_load_in_the_inference_dtype(fp32_ckpt, monkeypatch, capsys, device, want):
    from k3.ops import registry
    from k3.serve.build import build_engine

    monkeypatch.setattr(registry, "_notices", set())
    seen = _record_loads(monkeypatch, device)
    with pytest.raises(Loaded):
        build_engine(fp32_ckpt, device="auto")
    with pytest.raises(Loaded):
        cli._load_for_inference(fp32_ckpt, "auto", generate=True)
    with pytest.raises(Loaded):  # evaluation: the stored dtype (None: from_pretrained reads it)
        cli._load_for_inference(fp32_ckpt, "auto")
    assert seen == [want, want, None]
    said = "the checkpoint's float32 weights run in bfloat16 on cuda" in capsys.readouterr().err
    assert said == (device.type == "cuda")  # a dtype change is said; none on the CPU


def test_a_model_loaded_for_generation_requires_no_gradients(fp32_ckpt):
    # nothing that generates trains it, and the inference-only kernels (which refuse weights that require gradients
    # while gradients are enabled) then run whatever the caller's grad mode
    from k3.serve.build import load_for_generation

    model = load_for_generation(fp32_ckpt, CPU)
    assert not any(p.requires_grad for p in model.parameters())
