"""Step time of MXFP4 quantization-aware training against plain training, side by side in one run (report §4.1.4).

    python benchmarks/qat_overhead.py --preset k3-mini --seq-len 4096 --batch-tokens 32768 --steps 6   # one GPU
    python benchmarks/qat_overhead.py                                          # CPU: tiny, the reference only

Variants, each a fresh model with the same seed, data and trainer (Per-Head Muon, QK-Clip, Quantile Balancing,
MTP), under `--backend` for every other op:

* ``plain``: no quantization;
* ``qat-torch``: `k3.train.qat.apply_qat` (MXFP4 expert weights, MXFP8 expert inputs, straight-through) with the
  fake quantizers on their PyTorch reference (ops mxfp4_fake_quant / mxfp8_fake_quant = torch);
* ``qat-triton``: the same with the fused one-pass kernels of k3.ops.mx_triton (GPU only: on a CPU they run only
  in Triton's interpreter, which is a correctness tool).

The first two steps of each are warm-up; then the median of `--steps` synchronized steps. One JSON line per
variant with `overhead` = its step time over plain's, minus 1 (the issue's goal: <= 10% with the fused kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np
import torch

from k3.config import K3Config
from k3.data.packing import PackedLoader
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends, backends_from_env
from k3.train.qat import apply_qat
from k3.train.trainer import Trainer, TrainConfig

FAKE_QUANT_OPS = ("mxfp4_fake_quant", "mxfp8_fake_quant")


def run(variant: str, args, cfg: K3Config, base: Backends, dev: torch.device) -> dict:
    per_op = dict(base.per_op)
    if variant != "plain":
        per_op.update({op: variant.split("-")[1] for op in FAKE_QUANT_OPS})
    backends = dataclasses.replace(base, per_op=per_op)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg, backends=backends).init_weights(seed=0)
    if variant != "plain":
        apply_qat(model, "mxfp4")
    model = model.to(dev)
    stream = np.random.default_rng(0).integers(1, cfg.vocab_size, size=args.batch_tokens * (args.steps + 3),
                                               dtype=np.int64).astype(np.int32)
    tc = TrainConfig(out="/tmp/k3-bench-qat", max_steps=10**6, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                     device=str(dev), autocast_bf16=dev.type == "cuda", eval_every=10**9)
    tr = Trainer(model, tc, PackedLoader(stream, args.seq_len, tc.rows_per_step, eos_id=0, seed=0),
                 log=lambda *a: None)
    times = []
    for i in range(args.steps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = tr.train_step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return dict(variant=variant, preset=args.preset, device=torch.cuda.get_device_name() if dev.type == "cuda"
                else "cpu", seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                step_s_median=round(statistics.median(times), 4), loss=round(m.loss, 4))


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = K3Config.from_preset(args.preset)
    if args.vocab_size:
        cfg = cfg.replace(vocab_size=args.vocab_size)
    base = backends_from_env(os.environ, default=args.backend)
    variants = ["plain", "qat-torch"] + (["qat-triton"] if dev.type == "cuda" else [])
    rows = []
    for v in variants:
        row = run(v, args, cfg, base, dev)
        row["overhead"] = round(row["step_s_median"] / rows[0]["step_s_median"] - 1, 4) if rows else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
