"""Host time of the serving engine itself per decode step: scheduling, prefix-cache bookkeeping, sampling and
output handling, with the model's forward replaced by a constant (no device work).

    python benchmarks/engine_overhead.py [--preset k3-mini] [--batch 64] [--context 8192] [--no-prefix-cache]
                                         [--output-tokens 2] [--detokenize]

The model is built on the meta device (no weights in memory); the page pool is real. The stub's logits are 128
columns wide, not the vocabulary (every request samples "a"): on a GPU the sampling's argmax over the vocabulary is
device work, and on a CPU it would take most of the step (about 1 ms at batch 64 on 2 cores). Prints the step time
of 5 rounds of 40 decode steps (ms, sorted), torch on one thread; with --detokenize, for a byte-level tokenizer's
text decoded from the whole output and from the new tokens only (k3.serve.detok), side by side. On a GPU the
engine's host time adds to each step, since a step ends with the sampled tokens read back.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.runner import ForwardResult
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--cache-mb", type=float, default=8192)
    ap.add_argument("--output-tokens", type=int, default=2,
                    help="tokens each request decodes before the timed rounds (the output's length then)")
    ap.add_argument("--detokenize", action="store_true",
                    help="with the byte-level tokenizer: the text decoded per token, the whole output against only "
                         "the new tokens (Postprocessor.incremental), side by side")
    args = ap.parse_args()
    if args.batch < 1 or args.output_tokens < 1:
        ap.error("--batch and --output-tokens must be positive")
    cfg = K3Config.from_preset(args.preset).replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model = model.to_empty(device="cpu")  # parameters are never read: the forward is replaced below
    torch.set_num_threads(1)
    row = {"preset": args.preset, "batch": args.batch, "context": args.context, "output_tokens": args.output_tokens,
           "prefix_cache": not args.no_prefix_cache}
    if not args.detokenize:
        print(json.dumps(row | {"step_ms_sorted": _rounds(model, cfg, args, None)}))
        return
    from k3.data.tokenizer import K3Tokenizer

    tok = K3Tokenizer.byte_level()
    for incremental in (False, True):
        print(json.dumps(row | {"detokenize": "new tokens" if incremental else "whole output",
                                "step_ms_sorted": _rounds(model, cfg, args, (tok, incremental))}), flush=True)


def _rounds(model, cfg, args, detok) -> list[float]:
    """The sorted ms per step of 5 rounds of 40 decode steps of a fresh engine (`detok`: (tokenizer, incremental)
    for its postprocessor, else no text)."""
    eng = LLMEngine(model, None, EngineConfig(
        cache_memory_mb=args.cache_mb, enable_prefix_cache=not args.no_prefix_cache, cuda_graphs=False,
        scheduler=SchedulerConfig(max_step_tokens=8192, prefill_chunk=8192, max_num_seqs=args.batch,
                                  long_prompt_tokens=10**9)))
    eng.eos_id = None
    if detok is not None:
        eng.post.tokenizer, eng.post.incremental = detok
    # narrow logits (the host's work, not a CPU argmax over the vocabulary), every row's largest at the id of "a"
    logits = torch.zeros(args.batch, 128)
    logits[:, detok[0].encode("a")[0] if detok is not None else 65] = 1.0
    eng.runner.execute = lambda batch: ForwardResult(logits[:len(batch.tokens)])
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.output_tokens + 400, temperature=0)
    seqs = [eng.add_request(torch.randint(1, cfg.vocab_size, (args.context,), generator=g).tolist(), params)
            for _ in range(args.batch)]
    while any(len(s.output_ids) < args.output_tokens for s in seqs):
        eng.step()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(40):
            eng.step()
        rounds.append((time.perf_counter() - t0) / 40 * 1e3)
    return sorted(round(t, 3) for t in rounds)


if __name__ == "__main__":
    main()
