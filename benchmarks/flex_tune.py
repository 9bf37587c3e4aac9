"""Block sizes of the flex_attention MLA kernels at k3-mini's training shape, measured one configuration at a time.

    python benchmarks/flex_tune.py [--tokens 32768] [--seq-len 8192] [--configs fwd|bwd|all] [--autotune]

Gated MLA has 192-dim queries/keys and 128-dim values; torch's built-in flex tables have no tuned entry for that
shape on sm90, so the defaults may leave speed behind. Each configuration is passed to flex_attention as
``kernel_options`` (``fwd_*`` keys for the forward kernel, ``bwd_*`` for the backward) and compiled on its own;
each line printed is one JSON record with the median forward and forward+backward times (triton.testing.do_bench)
and the achieved TFLOP/s against the measured bf16 peak (803 TFLOP/s), counting only the visible
(causal, same-document) query/key pairs. A configuration that does not fit (shared memory, registers) is reported
with its error and skipped. ``--autotune`` adds inductor's max-autotune choice for comparison (minutes).

The winning options go into ``k3/ops/mla_flex.py``'s table (``_FLEX_TUNED``), or per run into the environment variable
``K3_FLEX_KERNEL_OPTIONS`` as a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK_BF16 = 803e12

FWD = [  # BLOCK_M, BLOCK_N, num_stages, num_warps
    (64, 64, 3, 4), (128, 64, 3, 8), (128, 64, 2, 8), (128, 32, 3, 8), (64, 128, 2, 4), (128, 128, 1, 8),
    (64, 64, 2, 8),
]
BWD = [  # BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps
    (64, 64, 64, 64, 2, 4), (64, 64, 64, 64, 3, 4), (64, 64, 64, 64, 2, 8), (64, 64, 64, 64, 1, 8),
    (32, 64, 64, 32, 3, 4), (64, 128, 128, 64, 2, 8), (64, 128, 128, 64, 1, 8), (32, 128, 128, 32, 3, 4),
    (32, 64, 64, 32, 2, 4),
]
BWD_NEAR = [  # around the best of BWD on an H200 (64, 128, 128, 64, 2, 8)
    (64, 128, 128, 64, 3, 8), (64, 128, 128, 64, 2, 4), (32, 128, 128, 32, 2, 8), (64, 128, 128, 64, 4, 8),
    (128, 128, 128, 128, 2, 8), (64, 64, 64, 64, 3, 8), (32, 128, 128, 32, 2, 4),
]


def packed_segments(B: int, T: int, mean_doc: int, seed: int = 0) -> torch.Tensor:
    """[B, T] document ids of rows packed with documents of random (exponential) lengths, as training batches."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        pos, doc = 0, 0
        while pos < T:
            n = max(1, int(torch.empty(1).exponential_(1.0 / mean_doc, generator=g)))
            seg[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return seg


def visible_pairs(seg: torch.Tensor) -> int:
    total = 0
    for row in seg:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        total += int((counts * (counts + 1) // 2).sum())
    return total


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mean-doc", type=int, default=3000, help="mean packed document length")
    ap.add_argument("--configs", choices=["fwd", "bwd", "all", "bwd-near"], default="all",
                    help="bwd-near: backward tiles around the best of the bwd set")
    ap.add_argument("--autotune", action="store_true", help="also time inductor's max-autotune choice")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flex_tune.py needs a CUDA GPU")
    import triton.testing
    from torch.nn.attention import flex_attention as fa

    from k3.ops.mla import causal_block_mask

    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    B, T, H = max(1, args.tokens // args.seq_len), args.seq_len, args.heads
    seg = packed_segments(B, T, args.mean_doc)
    flops = 2 * visible_pairs(seg) * H * (192 + 128)  # forward; backward is 2.5x that
    seg = seg.cuda()
    mk = lambda d: torch.randn(B, H, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(192), mk(192), mk(128)
    bm = causal_block_mask(T, q.device, seg)
    scale = 192 ** -0.5
    plain = torch.compile(fa.flex_attention, dynamic=False)
    cases: list[tuple[str, dict, object]] = [("torch's default", {}, plain)]
    if args.configs in ("fwd", "all"):
        cases += [(f"fwd {c}", dict(fwd_BLOCK_M=c[0], fwd_BLOCK_N=c[1], fwd_num_stages=c[2], fwd_num_warps=c[3]),
                   plain) for c in FWD[1:]]
    if args.configs in ("bwd", "all"):
        cases += [(f"bwd {c}", dict(bwd_BLOCK_M1=c[0], bwd_BLOCK_N1=c[1], bwd_BLOCK_M2=c[2], bwd_BLOCK_N2=c[3],
                                    bwd_num_stages=c[4], bwd_num_warps=c[5]), plain) for c in BWD[1:]]
    if args.configs == "bwd-near":
        cases += [(f"bwd {c}", dict(bwd_BLOCK_M1=c[0], bwd_BLOCK_N1=c[1], bwd_BLOCK_M2=c[2], bwd_BLOCK_N2=c[3],
                                    bwd_num_stages=c[4], bwd_num_warps=c[5]), plain) for c in BWD_NEAR]
    if args.autotune:
        cases.append(("max-autotune", {}, torch.compile(fa.flex_attention, dynamic=False,
                                                        mode="max-autotune-no-cudagraphs")))
    print(json.dumps({"shape": f"{B}x{T}x{H} 192/128", "visible_fraction": round(flops / (2 * B * T * T * H * 320), 4),
                      "device": torch.cuda.get_device_name()}), flush=True)
    for name, opts, fn in cases:
        t0 = time.perf_counter()
        try:
            def f(opts=opts, fn=fn):
                return fn(q, k, v, block_mask=bm, scale=scale, kernel_options=opts or None)

            def fb(f=f):
                f().sum().backward()

            fb()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            with torch.no_grad():
                tf = triton.testing.do_bench(f, warmup=5, rep=40)
            tfb = triton.testing.do_bench(fb, warmup=5, rep=40)
        except Exception as e:  # a configuration that does not fit this GPU: say so, go on
            print(json.dumps({"config": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}),
                  flush=True)
            torch._dynamo.reset()
            continue
        tb = tfb - tf
        print(json.dumps({"config": name, "options": opts, "compile_s": round(compile_s, 1), "fwd_ms": round(tf, 3),
                          "bwd_ms": round(tb, 3), "fwd_bwd_ms": round(tfb, 3),
                          "fwd_tflops": round(flops / tf / 1e9, 1), "bwd_tflops": round(2.5 * flops / tb / 1e9, 1),
                          "fwd_bwd_frac_of_peak": round(3.5 * flops / tfb / 1e9 / (PEAK_BF16 / 1e12), 3)}),
              flush=True)


if __name__ == "__main__":
    main()
