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

