"""Small tensor helpers: host-to-device copies that do not wait for the device, and a one-entry result cache."""

from __future__ import annotations

from typing import Callable


def to_device_async(t, device):
    """A host tensor on `device`. To CUDA through pinned memory without waiting: a copy from pageable memory
    synchronizes the host with the device, so the host could not queue work ahead of the device."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class LastResult:
    """The value built for the last key, returned again while the key stays the same: for work that many callers
    repeat on the same input (every layer of one forward). Tensors in the key match by identity and version (the
    same tensor, not modified in place since), other items by equality. Holds one entry and its key's tensors."""

    def __init__(self):
        self._key: tuple | None = None
        self._value = None

    @staticmethod
    def _signature(key: tuple) -> tuple:
        import torch

        return tuple((k, k._version if torch.is_tensor(k) else None) for k in key)

    def get(self, key: tuple, build: Callable[[], object]):
        import torch

        sig = self._signature(key)
        old = self._key
        if old is not None and len(old) == len(sig) and all(
                (a is b if torch.is_tensor(a) or torch.is_tensor(b) else a == b) and va == vb
                for (a, va), (b, vb) in zip(sig, old)):
            return self._value
        self._value = build()
        self._key = sig
        return self._value
