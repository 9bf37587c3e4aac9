"""Building blocks shared by the model's layers: RMSNorm and the dense SiTU-GLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.ops.situ import situ_glu_any


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the normalized value is cast back before the weight, as the release does."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # x * rsqrt(mean(x^2) + eps) in fp32: one fused kernel on CUDA, the same ops as written out on CPU.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight * y.to(dtype)).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SituMLP(nn.Module):
    """Dense FFN (layer 0) and the fused shared experts: down(SiTU-GLU(gate x, up x)), report §2.3.2."""

    def __init__(self, hidden: int, intermediate: int, beta1: float, beta2: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta1, self.beta2 = beta1, beta2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu_any(self.gate_proj(x), self.up_proj(x), self.beta1, self.beta2))
