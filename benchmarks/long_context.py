"""One forward + backward of a preset at a long context on one GPU, with activation checkpointing.

    python benchmarks/long_context.py --preset k3-mini --seq-len 131072

Runs the training loss (next token + MTP) of one sequence of random tokens under bf16 autocast on the fast
backends, with activation checkpointing (each sublayer's activations recomputed in backward), and prints the
time of the second forward + backward (the first compiles the kernels), tokens/s, model FLOP utilization
(6 x active parameters + causal MLA attention FLOPs per token, x 4/3 for the recomputed forward, over
803 TFLOP/s) and the peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from k3.config import K3Config
from k3.info import model_info
from k3.model.model import K3ForCausalLM
from k3.ops.registry import backends_from_env

PEAK_BF16 = 803e12


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--no-checkpointing", action="store_true", help="keep every activation (needs more memory)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("long_context.py needs a CUDA device")
    cfg = K3Config.from_preset(args.preset).replace(vocab_size=args.vocab_size)
    backends = backends_from_env(os.environ, default="fast")  # every fast path, but ops pinned by K3_<OP>_BACKEND
    model = K3ForCausalLM(cfg, backends=backends).init_weights(seed=0).cuda().train()
    model.set_activation_checkpointing(not args.no_checkpointing)
    ids = torch.randint(1, cfg.vocab_size, (1, args.seq_len), device="cuda")
    # One document, passed as the trainer passes its packed batches (segment ids): the KDA kernels then run their
    # variable-length form, whose autotuning results ship in benchmarks/autotune (the fixed-length form would
    # autotune anew for minutes), and MLA runs with the document mask as in training.
    seg = torch.zeros_like(ids)
    times = []
    for i in range(2):
        print(f"forward + backward {i + 1} of 2 ({'compiles kernels first' if i == 0 else 'timed'})", flush=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, labels=ids, segment_ids=seg)
        loss = out.loss + 0.3 * out.mtp_loss
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    dt = times[-1]
    info = model_info(cfg, context=args.seq_len)
    attn = 12 * len(cfg.full_attn_layers) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) \
        * args.seq_len / 2
    flops = (6 * info.active + attn) * args.seq_len
    if not args.no_checkpointing:
        flops *= 4 / 3  # the forward runs twice
    print(json.dumps({
        "preset": args.preset, "seq_len": args.seq_len, "checkpointing": not args.no_checkpointing,
        "device": torch.cuda.get_device_name(), "first_call_s": round(times[0], 2), "fwd_bwd_s": round(dt, 3),
        "tokens_per_s": round(args.seq_len / dt, 1), "hardware_flops_util": round(flops / dt / PEAK_BF16, 4),
        "loss": round(float(out.loss.detach()), 4), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }))


if __name__ == "__main__":
    main()
