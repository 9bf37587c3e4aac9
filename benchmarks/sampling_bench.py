"""A decode step's sampling and logprobs, one row at a time against batched, side by side in one run.

    python benchmarks/sampling_bench.py [--batch 1 16 64] [--vocab 32768] [--device cuda] [--logprobs 0] [--unseeded]

What an RL rollout's step asks of the postprocess step: every request sampled at temperature 1 from its own seeded
generator, and its token's logprob recorded (`--logprobs`: the number of alternatives besides, 0 as `k3 rl` asks).
Two arms over the same logits:

* ``per-row``: the earlier way, each sampled row's distribution computed and drawn from (torch.multinomial) on its
  own and written into the step's token tensor, then each row's log-softmax and top-k, with a read-back per value
  (the token's logprob, each alternative's id and logprob);
* ``batched``: k3.serve.sampling.sample_step (the distributions of all rows in one pass, one uniform number per row
  from its generator, or from one draw for all unseeded rows, and one inverse transform, the tokens left on the
  device) and k3.serve.postprocess.read_step (one log-softmax, top-k and gather for all rows, read back with the
  tokens: one read-back per step).

Prints milliseconds per step (median of --runs, each synchronized) per arm and batch size; on CUDA also the kernels
each arm launches per step (torch.profiler). The two arms draw from the same distributions with different noise, so
their tokens differ; tests/serve/test_sampling.py checks the batched arm against the distributions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3.cli_args import DefaultsHelpFormatter
from k3.serve.postprocess import read_step
from k3.serve.sampling import SamplingParams, probs, sample_step


def per_row(logits: torch.Tensor, params: list[SamplingParams], gens: list, ks: list[int]) -> list:
    """The earlier postprocess step: a draw per row, then per-row logprob entries read back value by value."""
    out = logits.float().argmax(-1)
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = torch.multinomial(probs(logits[i:i + 1], p), 1, generator=gens[i])[0, 0]
    toks = out.tolist()
    entries = []
    for i, k in enumerate(ks):
        logp = torch.log_softmax(logits[i].float(), -1)
        top = torch.topk(logp, max(k, 1))
        entries.append({"token": toks[i], "logprob": float(logp[toks[i]]),
                        "top": [(int(j), float(v)) for v, j in zip(top.values, top.indices)][:k]})
    return entries


def batched(logits: torch.Tensor, params: list[SamplingParams], gens: list, ks: list[int]) -> list:
    """The postprocess step: the tokens drawn on the device, then read back with every row's logprob entry at once."""
    return read_step(logits, sample_step(logits, params, gens), list(range(len(ks))), ks)[1]


def _time(fn, dev: torch.device, runs: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(runs):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _top_kernels(fn, n: int) -> dict[str, float]:
    """The `n` kernels of one call of `fn` with the most device time: {name (first 60 characters): microseconds}."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:60]] = total.get(e.name[:60], 0.0) + e.device_time_total
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:n]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--logprobs", type=int, default=0)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--unseeded", action="store_true", help="requests without a seed (a server's usual traffic) "
                    "instead of each with its own seeded generator (an RL rollout's)")
    ap.add_argument("--top-kernels", type=int, default=0, help="on CUDA, also print the batched arm's N kernels "
                    "with the most device time (torch.profiler)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if min(args.batch) < 1 or args.vocab < 2 or args.logprobs < 0 or args.runs < 1:
        ap.error("--batch, --vocab and --runs must be positive, --logprobs non-negative")
    dev = torch.device(args.device)
    for B in args.batch:
        logits = torch.randn(B, args.vocab, device=dev, generator=torch.Generator(dev).manual_seed(B)) * 3
        params = [SamplingParams(temperature=1.0, logprobs=args.logprobs, seed=i) for i in range(B)]
        gens = [None] * B if args.unseeded else [torch.Generator(dev).manual_seed(i) for i in range(B)]
        ks = [args.logprobs] * B
        row = {"device": str(dev), "batch": B, "vocab": args.vocab, "seeded": not args.unseeded}
        for name, fn in (("per-row", per_row), ("batched", batched)):
            run = lambda fn=fn: fn(logits, params, gens, ks)  # noqa: E731
            row[f"{name}_ms"] = round(_time(run, dev, args.runs), 3)
            if dev.type == "cuda":
                row[f"{name}_kernels"] = _kernels(run)
                if name == "batched" and args.top_kernels:
                    row["batched_top_kernels_us"] = _top_kernels(run, args.top_kernels)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
