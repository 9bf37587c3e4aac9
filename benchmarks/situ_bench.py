"""SiTU-GLU on [N, 2F] bf16 (the output of one [w1; w3] GEMM): the fused Triton kernels
(k3.ops.situ_triton.situ_glu_fused) vs the eager reference (k3.ops.situ.situ_glu on the two halves), forward
and forward+backward, against a plain device copy of the same number of bytes (the bandwidth roofline).

The op is elementwise: its bound is memory bandwidth. Bytes moved are the minimum any implementation needs, per row:
forward reads 2F and writes F elements; backward reads 2F (h13) + F (dy) and writes 2F; forward+backward is
the sum. Two median times per case: `ms` from triton.testing.do_bench (each call launched from Python, so
host overhead shows wherever the host is slower than the GPU: the fused forward+backward at 65536x1024 is
such a case on a slow host) and `gpu_ms` from do_bench_cudagraph (the calls replayed from a CUDA graph: GPU
time alone). GB/s = bytes / gpu_ms, for every implementation alike (for the eager reference an effective
rate: it moves more); `of_copy` = copy time / op gpu_ms, the fraction of the measured copy bandwidth
(`copy_GB/s`, about 4.1 TB/s on an H200).

    python benchmarks/situ_bench.py --shapes 65536x1024 262144x512
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from k3.ops.situ import situ_glu


def bench(N: int, F: int, dtype: torch.dtype, rep_ms: int) -> list[dict]:
    import triton.testing

    from k3.ops.situ_triton import situ_glu_fused

    def timed(fn):
        """(do_bench median ms, CUDA-graph replay median ms)."""
        return (triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"),
                triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))

    h13 = (torch.randn(N, 2 * F, device="cuda", dtype=dtype) * 4).requires_grad_()
    dy = torch.randn(N, F, device="cuda", dtype=dtype)
    impls = {
        "fused": lambda: situ_glu_fused(h13),
        "eager": lambda: situ_glu(h13[:, :F], h13[:, F:]),
    }
    elems = {"fwd": 3 * F * N, "fwd_bwd": 8 * F * N}  # read 2F + write F; plus read 3F + write 2F
    rows = []
    for pass_, n_elems in elems.items():
        nbytes = n_elems * h13.element_size()
        src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)  # a copy reads and writes it: nbytes
        # One large launch, so do_bench's time is GPU time; replayed from a CUDA graph (a fresh output
        # buffer per call, from the graph's pool) the copy measured ~35% slower on an H200.
        copy_ms = triton.testing.do_bench(lambda: torch.empty_like(src).copy_(src), rep=rep_ms, return_mode="median")
        for name, fn in impls.items():
            if pass_ == "fwd":
                with torch.no_grad():
                    ms, gpu_ms = timed(fn)
            else:  # autograd.grad, not .backward(): no accumulation into h13.grad inside the timing
                ms, gpu_ms = timed(lambda: torch.autograd.grad(fn(), h13, dy))
            rows.append({"shape": f"{N}x{F}", "impl": name, "pass": pass_, "ms": round(ms, 4),
                         "gpu_ms": round(gpu_ms, 4), "MB": round(nbytes / 1e6, 1),
                         "GB/s": round(nbytes / gpu_ms / 1e6, 1), "copy_GB/s": round(nbytes / copy_ms / 1e6, 1),
                         "of_copy": round(copy_ms / gpu_ms, 3)})
    return rows


def main():
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["65536x1024", "262144x512"], help="N x F")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement (do_bench rep)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("situ_bench.py needs a CUDA device (the fused kernels run on GPU; see k3.ops._triton.runnable)")
    for s in args.shapes:
        N, F = map(int, s.split("x"))
        for row in bench(N, F, getattr(torch, args.dtype), args.rep_ms):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
