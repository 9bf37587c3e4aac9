"""Which device a command runs on: `--device auto|cpu|cuda[:N]`, shared by training, evaluation and serving."""

from __future__ import annotations

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def check_device(spec: str) -> str:
    """`spec` normalized (lower case) when it names a device k3 runs on, else a ValueError naming it (torch's own
    error for an unknown type is a long list of device types it knows, most of which k3 cannot run on)."""
    s = str(spec).strip().lower()
    if s == "auto":
        return s
    try:
        dev = torch.device(s)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"--device {spec!r} is not a device k3 runs on: use {DEVICE_CHOICES}")
    return s


def pick_device(spec: str) -> torch.device:
    """`auto`: CUDA when available, else the CPU; otherwise the device named, refused when it is CUDA and no
    CUDA device is available, or not a device k3 runs on (check_device)."""
    spec = check_device(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec} was asked for but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")
    return dev
