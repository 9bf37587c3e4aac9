"""Hack: return a tensor subclass (a stand-in for a lazy result that computes when it is looked at)."""

import torch


class Deferred(torch.Tensor):
    pass


def kernel(x, weight, eps):
    xf = x.float()
    y = (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)
    return y.as_subclass(Deferred)
