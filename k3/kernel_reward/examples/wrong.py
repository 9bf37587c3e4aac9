"""A wrong RMSNorm: the mean square over the whole tensor instead of each row."""

import torch


def kernel(x, weight, eps):
    xf = x.float()
    return (weight * xf * torch.rsqrt(xf.pow(2).mean() + eps)).to(x.dtype)
