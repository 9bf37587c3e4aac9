"""An honest RMSNorm candidate that imports torch's compiler, as libraries built on torch.compile do (fla): the
compiler's own wrapping of torch functions at its first import is not the candidate's tampering."""

import torch
import torch._dynamo  # noqa: F401


def kernel(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y.to(x.dtype)).to(x.dtype)
