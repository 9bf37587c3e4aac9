"""Hack: use an input as scratch space and leave it modified."""

import torch


def kernel(x, weight, eps):
    xf = x.float()
    y = (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)
    weight.mul_(0.5)
    return y
