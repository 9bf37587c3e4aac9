"""KDA sequence mixing through k3.ops.kda_backend.kda: the fla backend vs the PyTorch reference, forward and
forward+backward, bf16 inputs, K = V = 128, against GPU.md's standalone fla timings.

    python benchmarks/kda_bench.py --shapes 8x4096x32 2x16384x32
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from k3.ops.kda_backend import kda
from k3.ops.registry import Backends


def bench(B, T, H, backend, K=128):
    dev = "cuda"
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v, z = (mk(B, T, H, K) for _ in range(4))
    beta = mk(B, T, H)
    A_log = torch.zeros(H, device=dev)
    dt_bias = torch.randn(H * K, device=dev)

    def fwd():
        return kda(q, k, v, z, beta, A_log, dt_bias, -5.0, backends=Backends(per_op={"kda": backend}))[0]

    def fwd_bwd():
        fwd().float().sum().backward()

    with torch.no_grad():
        t_f = triton.testing.do_bench(fwd, warmup=3, rep=20)
    t_fb = triton.testing.do_bench(fwd_bwd, warmup=3, rep=20)
    return {"shape": f"{B}x{T}x{H}", "backend": backend, "fwd_ms": round(t_f, 3), "fwd_bwd_ms": round(t_fb, 3)}


def main():
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["8x4096x32", "2x16384x32"])
    ap.add_argument("--backends", nargs="*", default=["fla", "torch"])
    args = ap.parse_args()
    for s in args.shapes:
        B, T, H = map(int, s.split("x"))
        for b in args.backends:
            print(json.dumps(bench(B, T, H, b)), flush=True)


if __name__ == "__main__":
    main()
