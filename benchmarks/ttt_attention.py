"""The EAGLE-3 training-time test's attention: the explicit mask over every step's rows against the banded form,
side by side in one run (k3.posttrain.eagle3: TTTContext, `ttt_attention`).

    python benchmarks/ttt_attention.py                               # CPU, tiny target, rows of 512 tokens
    python benchmarks/ttt_attention.py --preset k3-mini --seq-len 2048 --device cuda

One batch through the frozen target and the 7-step unrolled draft, LK loss, backward (what one `k3 train-draft`
step computes, without the optimizer), for `exact` (the [T, j T] mask at step j, O(28 T^2) scores over the 7 steps)
and `banded` (a [T, T] block over the step-1 keys and one diagonal per later step, O(7 T^2)). Reported: the median
seconds of --repeats (arms alternating), the peak memory on CUDA, and the largest difference of the draft's outputs
and of its gradients between the two (fp32 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    from k3.config import K3Config
    from k3.model.eagle3 import Eagle3Layer
    from k3.model.model import K3ForCausalLM
    from k3.posttrain.eagle3 import ttt_loss, unroll

    dev = torch.device(args.device)
    torch.manual_seed(0)
    target = K3ForCausalLM(K3Config.from_preset(args.preset)).init_weights(seed=0).to(dev).eval().requires_grad_(False)
    draft = Eagle3Layer.from_target(target).to(dev).train()
    with torch.no_grad():
        draft.fc.weight.add_(0.05 * torch.randn_like(draft.fc.weight))  # off [0 0 I]: every input matters
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (args.batch, args.seq_len), generator=g).to(dev)
    seg = torch.zeros_like(ids)
    seg[:, args.seq_len // 3:] = 1
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(exact: bool):
        draft.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync()
        t = time.perf_counter()
        u = unroll(target, draft, ids, seg, exact_mask=exact)
        loss = ttt_loss(u, "lk")[0]
        loss.backward()
        sync()
        sec = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        return sec, peak, [o.detach() for o in u.outputs], [p.grad.detach().clone() for p in draft.parameters()
                                                             if p.grad is not None]

    step(False)
    step(True)  # warm-up
    runs = {"exact": [], "banded": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(step(name == "exact"))
    out_diff = max(float((a - b).abs().max()) for a, b in zip(runs["exact"][0][2], runs["banded"][0][2]))
    grad_diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                    for a, b in zip(runs["exact"][0][3], runs["banded"][0][3]))
    rows = {k: dict(seconds=round(statistics.median(r[0] for r in v), 4),
                    peak_gib=None if v[0][1] is None else round(max(r[1] for r in v), 3)) for k, v in runs.items()}
    print(json.dumps(dict(preset=args.preset, seq_len=args.seq_len, batch=args.batch, device=str(dev), arms=rows,
                          speedup=round(rows["exact"]["seconds"] / rows["banded"]["seconds"], 3),
                          max_output_diff=out_diff, max_grad_rel_diff=grad_diff), indent=1))


if __name__ == "__main__":
    main()
