"""The MoE GEMV kernels (k3.ops.moe_gemv) and the MoE output kernel (k3.ops.moe_out) under several tile shapes, side
by side: microseconds per call and the fraction of a copy's bandwidth their weight reads reach, at k3-mini's shapes
and release-shaped ones (the release's widths, with fewer experts to fit one GPU); then the autotuned kernels (what
serving launches: their tables are the first rows here) with the shape each picked, and the output kernel with the
routed experts' combine and latent norm inside (op ``moe_combine_norm_out``) against the combine-norm kernel followed by
the output kernel.

    python benchmarks/moe_gemv_tune.py [--tokens 1 4 8]
"""

from __future__ import annotations

import argparse
import json

import torch

from k3.cli_args import DefaultsHelpFormatter
from k3.ops.moe_gemv import _TUNE_DOWN, _TUNE_GATE_UP
from k3.ops.moe_out import _TUNE_OUT

# the kernels' autotuning tables (what serving chooses among) and a few more shapes
GATE_UP = [*_TUNE_GATE_UP, (16, 512, 8), (4, 512, 2)]
DOWN = [*_TUNE_DOWN, (16, 1024, 8), (4, 512, 2)]
SHAPES = {"k3-mini": (128, 768, 512, 8), "release-shaped": (64, 3072, 3584, 16)}
# the output kernel: (rows of D per program, columns per step, warps); its shapes (L, I shared width, D)
OUT = [*_TUNE_OUT, (1, 1024, 4), (2, 2048, 8)]
OUT_SHAPES = {"k3-mini": (512, 1536, 1024), "release-shaped": (3584, 3072, 7168)}


def _sweep(row: dict, kernel: str, configs: list, launch, out: torch.Tensor, nbytes: int, copy_gbs: float) -> None:
    """Each tile shape of `configs` launched (`launch(*config)`, writing `out`), its output checked against the first
    shape's up to a bf16 step of the largest entry (fp32 sums in another order, then one rounding: a shape that
    computes something else stops the run), then timed: row[f"{kernel} AxB wW"] = "us per call, share of a copy's
    bandwidth for `nbytes` read". `out` holds the first shape's output afterwards."""
    from triton.testing import do_bench

    first = None
    for config in configs:
        launch(*config)
        if first is None:
            first = out.clone()
        else:
            err = (out.float() - first.float()).abs().max() / first.float().abs().max().clamp_min(1e-30)
            if err > 2 ** -7:
                raise SystemExit(f"{kernel} with tiles {config} differs from the first shape's output by "
                                 f"{float(err):.3g} of its largest entry")
        ms = do_bench(lambda: launch(*config))
        row[f"{kernel} {config[0]}x{config[1]} w{config[2]}"] = \
            f"{ms * 1e3:.1f} us {nbytes / ms / 1e6 / copy_gbs:.0%}"
    out.copy_(first)


def _tuned(row: dict, kernel: str, tuned, launch, nbytes: int, copy_gbs: float) -> None:
    """The autotuned kernel `tuned` (what serving launches), run by `launch()`: row[f"{kernel} autotuned"] = its time,
    share of a copy's bandwidth and the tile shape it picked."""
    from triton.testing import do_bench

    launch()  # the first call times every kept config
    ms = do_bench(launch)
    c = tuned.best_config
    shape = "x".join(str(v) for v in c.kwargs.values())
    row[f"{kernel} autotuned"] = f"{ms * 1e3:.1f} us {nbytes / ms / 1e6 / copy_gbs:.0%} ({shape} w{c.num_warps})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_gemv_tune.py needs a CUDA device")
    from triton.testing import do_bench

    from k3.ops.moe_gemv import _kernels

    gate_up, down, _ = _kernels(False, False)  # untuned: each tile shape launched as given
    tuned_gate_up, tuned_down, _ = _kernels(False, True)
    dev = torch.device("cuda")
    copy_src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = do_bench(lambda: copy_dst.copy_(copy_src))
    copy_gbs = 2 * copy_src.numel() / copy_ms / 1e6
    print(json.dumps({"copy_GBps": round(copy_gbs)}), flush=True)
    for name, (E, F, L, k) in SHAPES.items():
        w13 = torch.randn(E, 2 * F, L, device=dev, dtype=torch.bfloat16) * 0.02
        w1, w3 = w13[:, :F], w13[:, F:]
        w2 = torch.randn(E, L, F, device=dev, dtype=torch.bfloat16) * 0.02
        for N in args.tokens:
            g = torch.Generator(device=dev).manual_seed(N)
            idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(N)]).reshape(-1)
            pairs = N * k
            z = torch.randn(N, L, device=dev, dtype=torch.bfloat16)
            h = torch.empty(pairs, F, device=dev, dtype=torch.bfloat16)
            y = torch.empty(pairs, L, device=dev, dtype=torch.bfloat16)
            touched = idx.unique().numel()
            row = {"shape": name, "tokens": N, "experts_touched": touched}
            gu_bytes, d_bytes = touched * 2 * F * L * 2, touched * F * L * 2
            _sweep(row, "gate_up", GATE_UP, lambda bf, bl, nw: gate_up[(pairs, -(-F // bf))](
                z, idx, w1, w3, h, L, F, z.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), 4.0,
                25.0, 0, K=k, BLOCK_F=bf, BLOCK_L=bl, num_warps=nw), h, gu_bytes, copy_gbs)
            _sweep(row, "down", DOWN, lambda bl, bf, nw: down[(pairs, -(-L // bl))](
                h, idx, w2, y, L, F, w2.stride(0), w2.stride(1), 0, BLOCK_L=bl, BLOCK_F=bf, num_warps=nw), y, d_bytes,
                copy_gbs)
            lg = (pairs - 1).bit_length()
            _tuned(row, "gate_up", tuned_gate_up, lambda: tuned_gate_up[lambda m: (pairs, -(-F // m["BLOCK_F"]))](
                z, idx, w1, w3, h, L, F, z.stride(0), w1.stride(0), w1.stride(1), w3.stride(0), w3.stride(1), 4.0,
                25.0, lg, K=k), gu_bytes, copy_gbs)
            _tuned(row, "down", tuned_down, lambda: tuned_down[lambda m: (pairs, -(-L // m["BLOCK_L"]))](
                h, idx, w2, y, L, F, w2.stride(0), w2.stride(1), lg), d_bytes, copy_gbs)
            print(json.dumps(row), flush=True)
        del w13, w2
    from k3.ops.moe_gemv import moe_combine_norm_triton
    from k3.ops.moe_out import _kernel as out_kernel
    from k3.ops.moe_out import moe_combine_norm_out_triton, moe_out_triton

    kernel, tuned_out = out_kernel(False, False), out_kernel(False, True)
    for name, (L, I, D) in OUT_SHAPES.items():
        w_up = torch.randn(D, L, device=dev, dtype=torch.bfloat16) * 0.02
        w_down = torch.randn(D, I, device=dev, dtype=torch.bfloat16) * 0.02
        for N in args.tokens:
            a = torch.randn(N, L, device=dev, dtype=torch.bfloat16)
            gu = torch.randn(N, 2 * I, device=dev, dtype=torch.bfloat16)
            g, u = gu[:, :I], gu[:, I:]
            y = torch.empty(N, D, device=dev, dtype=torch.bfloat16)
            row = {"kernel": "moe_out", "shape": name, "tokens": N}
            _sweep(row, "out", OUT, lambda bd, bk, nw: kernel[(N, -(-D // bd))](
                a, g, u, w_up, w_down, y, L, I, D, a.stride(0), g.stride(0), u.stride(0), w_up.stride(0),
                w_down.stride(0), 4.0, 25.0, 0, a, a, 0.0, 0, BLOCK_D=bd, BLOCK_K=bk, num_warps=nw), y,
                (L + I) * D * 2, copy_gbs)
            _tuned(row, "out", tuned_out, lambda: tuned_out[lambda m: (N, -(-D // m["BLOCK_D"]))](
                a, g, u, w_up, w_down, y, L, I, D, a.stride(0), g.stride(0), u.stride(0), w_up.stride(0),
                w_down.stride(0), 4.0, 25.0, (N - 1).bit_length(), a, a, 0.0, 0), (L + I) * D * 2, copy_gbs)
            # the routed experts' combine and latent norm inside it (op moe_combine_norm_out) against the combine-norm
            # kernel followed by it, both autotuned as served
            k = SHAPES[name][3]
            pairs = torch.randn(N * k, L, device=dev, dtype=torch.bfloat16)
            pw = torch.rand(N, k, device=dev)
            nw = torch.ones(L, device=dev, dtype=torch.bfloat16)
            two = lambda: moe_out_triton(moe_combine_norm_triton(pairs, pw, nw, 1e-6, torch.bfloat16), g, u, w_up,
                                         w_down, 4.0, 25.0)
            one = lambda: moe_combine_norm_out_triton(pairs, pw, nw, 1e-6, g, u, w_up, w_down, 4.0, 25.0)
            two(), one()  # the first calls tune
            row["combine-norm then out"] = f"{do_bench(two) * 1e3:.1f} us"
            row["combine inside out"] = f"{do_bench(one) * 1e3:.1f} us"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
