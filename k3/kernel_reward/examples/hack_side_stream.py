"""Hack (CUDA): compute on a side stream the caller's stream never waits for."""

import torch

_side = None


def kernel(x, weight, eps):
    global _side
    if _side is None:
        _side = torch.cuda.Stream()
    out = torch.empty_like(x)
    _side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_side):
        torch.cuda._sleep(2_000_000)  # a long kernel
        xf = x.float()
        out.copy_((weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype))
    return out
