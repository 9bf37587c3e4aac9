"""The MTP draft's proposal time per decode step, batched (`MTPDraft.propose`: each request's first step alone,
then one forward per later step for all requests) against one request at a time (`propose_sequential`), side by
side in one run. Random weights (the time does not depend on them), each request with `--context` committed
positions observed and one new position per step, as in steady-state decoding.

    python benchmarks/draft_batching.py                              # tiny on a CPU
    python benchmarks/draft_batching.py --preset k3-mini --device cuda --batch 1 4 16 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--drafts", type=int, default=3, help="draft tokens per request (K)")
    ap.add_argument("--context", type=int, default=256, help="committed positions per request")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.serve.sampling import SamplingParams
    from k3.serve.sequence import Sequence
    from k3.serve.speculative.draft import MTPDraft

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = K3Config.from_preset(args.preset)
    model = K3ForCausalLM(cfg).init_weights(seed=0).to(dev, dtype).eval()
    D = cfg.hidden_size

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for B in args.batch:
        g = torch.Generator().manual_seed(B)
        seqs = []
        for i in range(B):
            s = Sequence(torch.randint(1, cfg.vocab_size, (args.context + 1,), generator=g).tolist(),
                         SamplingParams(max_tokens=64, temperature=0), request_id=f"b{B}-{i}")
            s.num_computed = args.context
            seqs.append(s)
        times = {}
        for mode in ("batched", "sequential"):
            draft = MTPDraft(model)
            for s in seqs:
                draft.observe(s, 0, torch.randn(args.context, D, device=dev, dtype=dtype))
            fn = draft.propose if mode == "batched" else draft.propose_sequential
            fn(seqs, [args.drafts] * B)  # the contexts' committed rows, and warm-up
            samples = []
            for r in range(args.repeats):
                for s in seqs:  # one more committed position per request, as after a decode step
                    s.prompt_ids.append(1)
                    s.num_computed += 1
                    draft.observe(s, s.num_computed - 1, torch.randn(1, D, device=dev, dtype=dtype))
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn(seqs, [args.drafts] * B)
                sync()
                samples.append(time.perf_counter() - t0)
            for s in seqs:  # the other mode starts from the same lengths
                del s.prompt_ids[args.context + 1:]
                s.num_computed = args.context
            times[mode] = statistics.median(samples) * 1e3
        row = dict(batch=B, drafts=args.drafts, batched_ms=round(times["batched"], 3),
                   sequential_ms=round(times["sequential"], 3),
                   speedup=round(times["sequential"] / times["batched"], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, device=args.device, context=args.context, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
