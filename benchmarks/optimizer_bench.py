"""Time one optimizer step (Per-Head Muon + AdamW) on a preset's parameters, against its compute floor.

    python benchmarks/optimizer_bench.py [--preset k3-mini] [--steps 5] [--backend auto|fast|torch]

The model is built with random gradients on every parameter (no forward pass), then `--steps` optimizer
steps are timed after one warm-up step (CUDA events on a GPU, wall clock on CPU). The record gives the
median step time, the Newton-Schulz FLOPs of one step (5 quintic iterations per block: X X^T, its square and
the product with X), the rate that makes, and the floor at the measured bf16 matrix peak (803 TFLOP/s),
plus how many blocks of each shape Muon orthogonalizes. One JSON line. `--backend` picks the momentum and update
passes around Newton-Schulz: PyTorch ops (torch), the fused Triton kernels of k3.ops.muon_update (fast; on CPU
only with TRITON_INTERPRET=1), or what k3.ops.registry decides (auto: the PyTorch passes; the kernels are not
validated for it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PEAK_BF16 = 803e12


def ns_flops(model, steps: int = 5) -> tuple[float, dict]:
    """Newton-Schulz FLOPs of one Muon step, and {"rows x cols": blocks} (rows <= cols after transposing)."""
    from k3.train.per_head_muon import _blocks, muon_param_groups

    flops, shapes = 0.0, {}
    for g in muon_param_groups(model):
        if not g["use_muon"]:
            continue
        for p in g["params"]:
            n, r, c = _blocks(torch.empty(p.shape, device="meta"), g["split"], g["num_blocks"]).shape
            r, c = min(r, c), max(r, c)
            flops += n * steps * (2 * r * r * c + 2 * r * r * r + 2 * r * r * c)
            shapes[f"{r}x{c}"] = shapes.get(f"{r}x{c}", 0) + n
    return flops, shapes


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="k3-mini", choices=["k3-mini", "tiny"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto",
                    help="the Muon update passes: fused Triton kernels (fast), PyTorch ops (torch), or auto")
    args = ap.parse_args()

    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import Backends
    from k3.train.per_head_muon import PerHeadMuon, muon_param_groups

    backends = Backends(default=args.backend)

    dev = torch.device(args.device)
    torch.manual_seed(0)
    with dev:
        model = K3ForCausalLM(K3Config.from_preset(args.preset))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = PerHeadMuon(muon_param_groups(model), backends=backends)
    opt.step()  # state allocation
    times = []
    for _ in range(args.steps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    flops, shapes = ns_flops(model)
    step_s = statistics.median(times)
    rec = {"preset": args.preset, "backend": args.backend,
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "params": sum(p.numel() for p in model.parameters()), "step_ms": round(step_s * 1e3, 2),
           "ns_tflop": round(flops / 1e12, 3), "ns_tflops_per_s": round(flops / step_s / 1e12, 1),
           "floor_ms_at_peak": round(flops / PEAK_BF16 * 1e3, 2), "blocks": shapes}
    if dev.type == "cuda":
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
