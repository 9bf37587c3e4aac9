"""An honest bf16 GEMM candidate: torch's matmul (fp32 accumulation)."""

import torch


def kernel(a, b):
    return torch.matmul(a, b)
