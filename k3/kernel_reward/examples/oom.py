"""A candidate that allocates without bound."""

import torch

_hoard = []


def kernel(x, weight, eps):
    while True:
        _hoard.append(torch.ones(64 << 20))  # 256 MiB, touched
