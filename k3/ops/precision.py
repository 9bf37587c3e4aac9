"""Where the spec requires fp32 math (KDA state, the router), bf16 autocast must not apply: autocast runs every
matmul in bf16 whatever its inputs' dtype."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor


def autocast_off(device_type: str):
    """A context in which autocast is off on `device_type` (a no-op where it is off already or unsupported)."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def fp32_math(fn):
    """Run `fn` with autocast off on the device of its first tensor argument, so its matmuls stay fp32."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dev = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        with autocast_off(dev):
            return fn(*args, **kwargs)

    return wrapper
