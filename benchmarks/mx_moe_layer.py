"""One release-shaped routed-expert layer served from MXFP4 storage, against dequantized bf16 and the floor.

    python benchmarks/mx_moe_layer.py [--experts 896] [--top-k 16] [--latent 3584] [--inter 3072]
                                      [--tokens 1 16 64] [--runs 20] [--device cuda] [--impls ...] [--graphs]

K3's routed experts (report §2.3, §4.1.4; checkpoint-layout.md §2.7): 896 experts of latent width 3584 and
expert width 3072, top-16, weights in MXFP4. For each token count the experts are drawn once (random MXFP4
storage), the routing uniformly (each token 16 distinct experts), and side by side in one run:

* ``packed-grouped``: k3.ops.mx_moe_grouped's expert-centric kernels on the packed storage (op mx_moe
  triton_grouped: each touched expert's packed rows read once per tile of its tokens), decoding through
  ``tl.dot_scaled``; ``packed-grouped-regs``: the same kernels with their own decode in registers;
  ``packed-grouped-bits``: with the weights' bf16 bits built by integer operations (decode="bits");
  ``packed-grouped-nibbles``: per 32-column scale block, the low nibbles against the even columns and the high ones
  against the odd, the block's sums scaled once (decode="nibbles");
* ``packed-triton``: k3.ops.mx_moe's token-centric kernels on the packed storage (what `k3 serve` runs with
  mx_moe=triton);
* ``packed-torch``: the reference (each touched expert decoded just before its GEMMs);
* ``bf16-grouped``: the experts decoded once at load to dense bf16 and run through the grouped GEMMs (op moe
  grouped: k3's path for a dequantized checkpoint), on GPU only, where the grouped GEMM takes bf16.

The floor is the bytes of the experts actually touched (packed codes + scales, or bf16 weights, for the distinct
experts the batch routes to) over the device's memory bandwidth (`--bandwidth`, GB/s; default 4000, the H200's
device-to-device copy counting bytes read and written, the figure the decode floors of serve_bench.py use: a kernel
that only reads streams at about that rate; an earlier default of 2000 counted reads at half of it, and the bf16
grouped GEMMs ran at 142% of that floor on an H100). Timings are medians over `--runs`
(CUDA events on GPU, wall clock on CPU) after a warm-up (which also autotunes the grouped kernels); with `--graphs`
each call is captured in a CUDA graph and replayed (a served decode step runs so: the GPU's time without the host's
launch overhead, which at a token or two is most of an eager call), the rows that cannot be captured timed eagerly
(the table's last column says which). One JSON line per
(tokens, implementation), then a table with each one's share of its floor and its speed against bf16-grouped. An
implementation that fails (a kernel that does not compile on this GPU) gets a row with its error, the others still
run, and the exit status is 1. The Triton kernels run only on a GPU (the interpreter is a correctness tool, not a
timing one). On a CPU the default shape is too large for memory: pass e.g. `--experts 64 --latent 512 --inter 512`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3.ops.moe import moe_experts_grouped
from k3.ops.mx import mxfp4_dequantize
from k3.ops.mx_moe import PackedExpertWeights, mx_moe_packed, mx_moe_packed_grouped, mx_moe_packed_triton
from k3.ops.situ import situ_glu

B1, B2 = 4.0, 25.0
IMPLS = ("packed-auto", "packed-grouped", "packed-grouped-regs", "packed-grouped-bits", "packed-grouped-nibbles",
         "packed-triton", "packed-torch", "bf16-grouped")
# compiled Triton: GPU only
KERNELS = ("packed-auto", "packed-grouped", "packed-grouped-regs", "packed-grouped-bits", "packed-grouped-nibbles",
           "packed-triton")


def random_packed(E: int, F: int, L: int, device) -> PackedExpertWeights:
    """Random MXFP4 storage: uniform codes, scales around 2^-8 (weights of magnitude ~1e-2, like trained ones),
    drawn on the device (the release shape is 15 GB of codes)."""
    g = torch.Generator(device=device).manual_seed(1)

    def codes(shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device=device)

    def scales(shape):
        return torch.randint(117, 122, shape, generator=g, dtype=torch.uint8, device=device)

    return PackedExpertWeights(codes((E, F, L // 2)), scales((E, F, L // 32)), codes((E, F, L // 2)),
                               scales((E, F, L // 32)), codes((E, L, F // 2)), scales((E, L, F // 32)))


def timed(fn, runs: int, device, graph: bool = False) -> tuple[float, bool]:
    """(median seconds of `runs` calls, whether they replayed a CUDA graph). With `graph` (CUDA), the call is
    captured once after its warm-up and the graph replayed, as a served decode step runs it: the GPU's time
    without the host's launches; a call that cannot be captured (a read-back to the host) is timed eagerly."""
    fn()  # warm-up (compilation, autotuning)
    replay = fn
    if graph and device.type == "cuda":
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                fn()
        except Exception:  # not capturable: eager below
            graph = False
        else:
            replay = g.replay
    graph = graph and device.type == "cuda"
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            replay()
            times.append(time.perf_counter() - t)
    return statistics.median(times), graph


def main() -> int:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4000.0, help="GB/s the floor assumes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--graphs", action="store_true",
                    help="time each implementation replayed from a CUDA graph (as a decode step runs), where it "
                         "captures")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to time")
    args = ap.parse_args()
    if any(n < 1 for n in args.tokens):
        ap.error(f"--tokens must be positive, got {args.tokens}")
    dev = torch.device(args.device)
    E, K, L, F = args.experts, args.top_k, args.latent, args.inter
    g = torch.Generator().manual_seed(0)
    w = random_packed(E, F, L, dev)
    dense = None
    # decoded expert by expert (a whole-tensor decode's int64 codes would not fit)
    if dev.type == "cuda" and "bf16-grouped" in args.impls:
        dense = []
        for i in (0, 2, 4):
            d = torch.empty(*w[i].shape[:-1], w[i].shape[-1] * 2, dtype=torch.bfloat16, device=dev)
            for e in range(E):
                d[e] = mxfp4_dequantize(w[i][e], w[i + 1][e], torch.bfloat16)
            dense.append(d)
    packed_per_expert = sum(t[0].numel() for t in w)
    bf16_per_expert = 3 * F * L * 2
    rows = []
    for N in args.tokens:
        z = (torch.randn(N, L, generator=g) * 0.5).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(dev)
        wt = torch.rand(N, K, generator=g).to(dev)
        touched = int(torch.unique(idx).numel())
        impls = {"packed-auto": lambda: mx_moe_packed_grouped(z, wt, idx, w, B1, B2, "mxfp8"),
                 "packed-grouped": lambda: mx_moe_packed_grouped(z, wt, idx, w, B1, B2, "mxfp8",
                                                                 decode="dot_scaled", gemv_tokens=0),
                 "packed-grouped-regs": lambda: mx_moe_packed_grouped(z, wt, idx, w, B1, B2, "mxfp8",
                                                                      decode="registers", gemv_tokens=0),
                 "packed-grouped-bits": lambda: mx_moe_packed_grouped(z, wt, idx, w, B1, B2, "mxfp8",
                                                                      decode="bits", gemv_tokens=0),
                 "packed-grouped-nibbles": lambda: mx_moe_packed_grouped(z, wt, idx, w, B1, B2, "mxfp8",
                                                                         decode="nibbles", gemv_tokens=0),
                 "packed-triton": lambda: mx_moe_packed_triton(z, wt, idx, w, B1, B2, "mxfp8"),
                 "packed-torch": lambda: mx_moe_packed(z, wt, idx, w, B1, B2, "mxfp8")}
        if dense is not None:
            impls["bf16-grouped"] = lambda: moe_experts_grouped(z, wt, idx, *dense,
                                                                lambda a, b: situ_glu(a, b, B1, B2))
        for name in IMPLS:
            if name not in args.impls or name not in impls or (name in KERNELS and dev.type != "cuda"):
                continue
            per = bf16_per_expert if name.startswith("bf16") else packed_per_expert
            floor = touched * per / (args.bandwidth * 1e9)
            row = dict(tokens=N, impl=name, touched_experts=touched, bytes_touched=touched * per,
                       floor_ms=round(floor * 1e3, 4), device=str(dev))
            try:
                runs = min(args.runs, 3) if name == "packed-torch" else args.runs  # the slow reference
                s, graphed = timed(impls[name], runs, dev, args.graphs)
            except Exception as e:  # a kernel that does not build here: its row says so, the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            else:
                row.update(ms=round(s * 1e3, 4), share_of_floor=round(floor / s, 3), graph=graphed)
            rows.append(row)
            print(json.dumps(row), flush=True)
    bf16 = {r["tokens"]: r["ms"] for r in rows if r["impl"] == "bf16-grouped" and "ms" in r}
    print(f"\n{'tokens':>6} {'impl':>19} {'ms':>9} {'floor ms':>9} {'of floor':>8} {'vs bf16':>8} {'graph':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>6} {r['impl']:>19} failed: {r['error'][:120]}")
            continue
        speed = f"{bf16[r['tokens']] / r['ms']:>7.2f}x" if r["tokens"] in bf16 else f"{'-':>8}"
        print(f"{r['tokens']:>6} {r['impl']:>19} {r['ms']:>9.3f} {r['floor_ms']:>9.3f} {r['share_of_floor']:>8.1%} "
              f"{speed} {'yes' if r['graph'] else 'no':>6}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
