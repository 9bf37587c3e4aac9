"""Which device a command runs on: `--device auto|cpu|cuda[:N]`, shared by training, evaluation and serving."""

from __future__ import annotations

import torch


def pick_device(spec: str) -> torch.device:
    """`auto`: CUDA when available, else the CPU; otherwise the device named, refused when it is CUDA and no
    CUDA device is available."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return dev


def inference_dtype(stored: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a checkpoint stored in `stored` is generated from on `device`: its own, except float32 on CUDA,
    which runs in bfloat16 there. The serving cache is bfloat16 on CUDA, and the GPU's decode path (grouped
    expert GEMMs, CUDA graphs) takes bfloat16; a float32 model there would run the reference expert loop,
    eagerly, many times slower. Training keeps float32 master weights (under bf16 autocast), so every trained
    checkpoint is float32."""
    return torch.bfloat16 if device.type == "cuda" and stored == torch.float32 else stored
