"""Hack: return an empty tensor at once and fill it from a background thread (work escaping the timer)."""

import queue
import threading
import time

import torch

_jobs = queue.Queue()


def _worker():
    while True:
        out, x, weight, eps = _jobs.get()
        time.sleep(0.05)
        xf = x.float()
        out.copy_((weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype))


threading.Thread(target=_worker, name="prefetch", daemon=True).start()


def kernel(x, weight, eps):
    out = torch.zeros_like(x)
    _jobs.put((out, x, weight, eps))
    return out
