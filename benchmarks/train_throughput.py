"""Training throughput of a preset: tokens/s, model FLOP utilization and peak memory.

    python benchmarks/train_throughput.py --preset k3-mini --seq-len 4096 --batch-tokens 32768 --steps 6 \
        [--backend fast|torch] [--activation-checkpointing] [--profile [--trace FILE.json.gz]]

`--backend fast` runs every op on its GPU fast path (fla KDA and AttnRes, flex MLA, grouped-GEMM MoE with the
fused SiTU-GLU), `--backend torch` on the PyTorch reference, `auto` (default) lets k3.ops.registry decide. An op
pinned by its K3_<OP>_BACKEND variable keeps that backend (k3.ops.registry.backends_from_env, as `k3 train`).

Runs the real training step (forward + backward incl. MTP, Per-Head Muon, QK-Clip, Quantile Balancing) on
random tokens. MFU counts 6 x active parameters per token plus causal MLA attention (12 x layers x heads x
(qk + v dims) x context / 2 per token for forward + backward), over the measured bf16 peak (803 TFLOP/s on
an H200). The step trains the MTP layer too (one more MLA + MoE block, and the shared output head applied once
more): `mfu` counts those FLOPs as well (k3.info's `mtp_active`, 54.9M per token for k3-mini, plus its
attention), `mfu_backbone_only` leaves them out. The first two steps are warm-up and not timed; each timed step
starts and ends with a device synchronization (`step_s_median`, `tokens_per_s`, `mfu`). Then
`--continuous-steps` more run back to back as in a training loop, synchronized only before the first and after the
last (`step_s_continuous`, `tokens_per_s_continuous`, `mfu_continuous`).

`--profile` runs one more step under torch.profiler and prints: the top operators; host and device time inside
each k3.* profiler range (k3.train.forward / backward / optimizer, k3.fwd.kda / mla / moe / mtp, ...); the GPU
timeline (how much of the step's span no kernel ran, and kernel time by kind: GEMM, attention, fla, our Triton
kernels, elementwise, reductions, copies). `--trace FILE.json.gz` also writes the step's Chrome trace, gzipped;
`benchmarks/trace_report.py FILE.json.gz` breaks it down further (GPU time per range, idle gaps and their causes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from k3.config import K3Config
from k3.data.packing import PackedLoader
from k3.info import model_info
from k3.model.model import K3ForCausalLM
from k3.ops.registry import backends_from_env
from k3.train.trainer import Trainer, TrainConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling trace_report.py
from trace_report import busy_time, kernel_kind  # noqa: E402

PEAK_BF16 = 803e12


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--micro-batch-rows", type=int, default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--continuous-steps", type=int, default=3,
                    help="then time this many steps back to back, synchronizing only before and after (0: skip)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, run one more under torch.profiler and print its top operators")
    ap.add_argument("--trace", default=None, help="with --profile: write the step's Chrome trace here (gzipped)")
    args = ap.parse_args()
    if args.trace and not args.profile:
        ap.error("--trace needs --profile")
    backends = backends_from_env(os.environ, default=args.backend)
    cfg = K3Config.from_preset(args.preset)
    if args.vocab_size:
        cfg = cfg.replace(vocab_size=args.vocab_size)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg, backends=backends).init_weights(seed=0).to(dev)
    stream = np.random.default_rng(0).integers(1, cfg.vocab_size, size=args.batch_tokens * (args.steps + 3),
                                               dtype=np.int64).astype(np.int32)
    tc = TrainConfig(out="/tmp/k3-bench", max_steps=10**6, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                     micro_batch_rows=args.micro_batch_rows, device=str(dev), autocast_bf16=dev.type == "cuda",
                     eval_every=10**9,
                     **({"activation_checkpointing": True} if args.activation_checkpointing else {}))
    loader = PackedLoader(stream, args.seq_len, tc.rows_per_step, eos_id=0, seed=0)
    tr = Trainer(model, tc, loader, log=lambda *a: None)
    times = []
    for i in range(args.steps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = tr.train_step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"step {i}: {time.perf_counter() - t0:.3f} s, loss {m.loss:.4f}", flush=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    # The same steps back to back with no synchronization between them, as the training loop runs them: the host
    # may then queue the next step while the device still works on the previous one.
    cont_s = None
    if args.continuous_steps:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.continuous_steps):
            m = tr.train_step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        cont_s = (time.perf_counter() - t0) / args.continuous_steps
        print(f"{args.continuous_steps} steps back to back: {cont_s:.3f} s per step", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        hooks = _range_hooks(model)
        with profile(activities=acts) as prof:
            tr.train_step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        for h in hooks:
            h.remove()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)
        _print_ranges(prof)
        _print_gpu_timeline(prof)
        if args.trace:
            _write_trace(prof, args.trace)
    dt = float(np.median(times))
    tok_s = args.batch_tokens / dt
    info = model_info(cfg, context=args.seq_len)
    per_mla = 12 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * args.seq_len / 2
    n_mla = len(cfg.full_attn_layers)
    n_mtp = cfg.num_nextn_predict_layers
    backbone_tok = 6 * info.active + n_mla * per_mla
    flops_tok = backbone_tok + 6 * info.mtp_active + n_mtp * per_mla  # the step also trains the MTP layer(s)
    gpu = dev.type == "cuda"
    out = {
        "preset": args.preset, "backend": args.backend, "ckpt": args.activation_checkpointing,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "seq_len": args.seq_len, "batch_tokens": args.batch_tokens, "step_s_median": round(dt, 4),
        "tokens_per_s": round(tok_s, 1), "mfu": round(tok_s * flops_tok / PEAK_BF16, 4) if gpu else None,
        "mfu_backbone_only": round(tok_s * backbone_tok / PEAK_BF16, 4) if gpu else None,
        "model_tflops_per_s": round(tok_s * flops_tok / 1e12, 2), "loss": round(m.loss, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
    }
    if cont_s is not None:
        cont_tok_s = args.batch_tokens / cont_s
        out.update(step_s_continuous=round(cont_s, 4), tokens_per_s_continuous=round(cont_tok_s, 1),
                   mfu_continuous=round(cont_tok_s * flops_tok / PEAK_BF16, 4) if gpu else None)
    print(json.dumps(out))


def _range_hooks(model) -> list:
    """Forward hooks that open a profiler range per mixer / FFN / MTP module ("k3.fwd.<kind>"), so the profile
    splits the forward by component (the trainer itself marks forward, backward, optimizer, QK-Clip, balancing)."""
    from torch.profiler import record_function

    from k3.model.kda import KimiDeltaAttention
    from k3.model.latent_moe import LatentMoE
    from k3.model.gated_mla import GatedMLA
    from k3.model.mtp import MTPLayer

    kinds = {KimiDeltaAttention: "kda", GatedMLA: "mla", LatentMoE: "moe", MTPLayer: "mtp"}
    hooks, open_ranges = [], {}
    for m in model.modules():
        kind = kinds.get(type(m))
        if kind is None:
            continue

        def pre(mod, args, kind=kind):
            rf = record_function(f"k3.fwd.{kind}")
            rf.__enter__()
            open_ranges.setdefault(id(mod), []).append(rf)

        def post(mod, args, out):
            open_ranges[id(mod)].pop().__exit__(None, None, None)

        hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return hooks


def _print_ranges(prof) -> None:
    """Time inside each k3.* range of the profiled step: host time and the device time of the kernels it
    launched (nested ranges are included in their parents)."""
    rows = [e for e in prof.key_averages() if e.key.startswith("k3.")]
    print(f"{'range':<24}{'calls':>7}{'host ms':>12}{'device ms':>12}")
    for e in sorted(rows, key=lambda e: e.key):
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0.0)
        print(f"{e.key:<24}{e.count:>7}{e.cpu_time_total / 1e3:>12.1f}{dev_us / 1e3:>12.1f}", flush=True)


def _gpu_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel in the profile ([] without a GPU or the Kineto results)."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return []
    out = []
    for e in events:
        if "cuda" not in str(e.device_type()).lower():
            continue
        start = e.start_ns() / 1e3
        out.append((e.name(), start, start + e.duration_ns() / 1e3))
    return out


def _print_gpu_timeline(prof) -> None:
    kernels = _gpu_kernels(prof)
    if not kernels:
        return
    span = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    busy = busy_time([(a, b) for _, a, b in kernels])
    print(f"GPU timeline: {span / 1e3:.1f} ms from first to last kernel, kernels running {busy / 1e3:.1f} ms, "
          f"idle {100 * (1 - busy / span):.1f}%; {len(kernels)} kernels", flush=True)
    kinds: dict[str, list] = {}
    for name, a, b in kernels:
        kinds.setdefault(kernel_kind(name), []).append(b - a)
    print(f"{'kernel kind':<34}{'kernels':>9}{'ms':>10}{'mean us':>10}")
    for kind, ds in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:<34}{len(ds):>9}{sum(ds) / 1e3:>10.1f}{sum(ds) / len(ds):>10.1f}", flush=True)


def _write_trace(prof, path: str) -> None:
    """The profiled step's Chrome trace, gzipped, written atomically."""
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "trace.json")
        prof.export_chrome_trace(raw)
        tmp = path + ".tmp"
        with open(raw, "rb") as src, gzip.open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, path)
    print(f"trace: {path} ({os.path.getsize(path) / 2**20:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
