"""Verifications in the prefill forward against verifications in a forward of their own, side by side in one run
(speculative decoding mixed with prefill, report §5.4.2).

    python benchmarks/mixed_verify.py                          # CPU, tiny with random weights
    python benchmarks/mixed_verify.py --ckpt runs/main --device cuda --requests 32 --prompt-tokens 512

A stream of requests arrives, one every --arrive-every engine steps, so that speculating requests decode while
newer ones prefill: the steps where both happen are the ones mixing changes. The same stream runs on two engines
over the same loaded model, greedy, with MTP drafts: `apart` (EngineConfig.mix_verify=False: the step's
verifications run as their own batched forward after the prefill chunks') and `mixed` (they join the chunks' packed
forward). Reported per arm: wall time of the whole stream, model forwards, the mean time of a step that both
prefills and verifies, and whether the outputs equal (they must). A warm-up stream runs first on each engine.
With CUDA graphs on, a chunk that would run as a graph replay keeps its graph (and the verifications theirs), so
on a GPU mixing applies to steps whose chunks are packed.
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


def _log(msg: str) -> None:
    print(f"[mixed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stream(engine, prompts, max_tokens: int, every: int) -> dict:
    """Submit prompts one every `every` steps, step until done; times every step that prefilled and verified."""
    from k3.serve.runner import ModelRunner
    from k3.serve.sampling import SamplingParams

    runner = engine.runner
    counts = {"forwards": 0, "kinds": set()}
    orig = runner.execute

    def spy(batch):  # which forwards run: plain, mixed (prefill and verifications) or verifications alone
        counts["forwards"] += 1
        n = len(batch.tokens)
        counts["kinds"].add("run" if not batch.n_verify else "verify" if batch.n_verify == n else "mixed")
        return orig(batch)

    runner.execute = spy
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seqs, pending = [], list(prompts)
    both, step = [], 0
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while pending or engine.has_work():
        if pending and step % every == 0:
            seqs.append(engine.add_request(list(pending.pop(0)), params))
        counts["kinds"] = set()
        prefilling = any(s.num_computed < len(s.prompt_ids) for s in seqs if s.finish_reason is None)
        ts = time.perf_counter()
        engine.step()
        sync()
        if prefilling and ("mixed" in counts["kinds"] or "verify" in counts["kinds"]):
            both.append(time.perf_counter() - ts)
        step += 1
    sync()
    wall = time.perf_counter() - t0
    del runner.execute  # back to the class's method
    assert isinstance(runner, ModelRunner)
    return dict(wall_s=wall, forwards=counts["forwards"], steps=step, outputs=[s.output_ids for s in seqs],
                both_steps=len(both), both_step_ms=1e3 * statistics.fmean(both) if both else None)


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="a checkpoint with an MTP layer (default: tiny, random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--arrive-every", type=int, default=2)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--cache-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="streams per arm, alternating arms (medians reported)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig

    dev = torch.device(args.device)
    if args.ckpt:
        from k3.checkpoint import from_pretrained
        from k3.cli import _resolve_ckpt

        model = from_pretrained(_resolve_ckpt(args.ckpt), device=dev,
                                dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    else:
        from k3.config import K3Config
        from k3.model.model import K3ForCausalLM

        model = K3ForCausalLM(K3Config.from_preset("tiny")).init_weights(seed=0).to(dev).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]

    def engine(mix: bool) -> LLMEngine:
        eng = LLMEngine(model, None, EngineConfig(
            cache_memory_mb=args.cache_mb, speculative="mtp", num_draft_tokens=args.num_draft_tokens,
            mix_verify=mix, max_model_len=args.prompt_tokens + args.max_tokens + 64,
            scheduler=SchedulerConfig(max_num_seqs=args.requests, prefill_chunk=args.prefill_chunk)))
        eng.eos_id = None  # every request generates max_tokens tokens
        return eng

    engines = {"apart": engine(False), "mixed": engine(True)}
    for name, eng in engines.items():
        stream(eng, prompts[:2], 4, 1)  # warm-up
    runs = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, eng in engines.items():
            runs[name].append(stream(eng, prompts, args.max_tokens, args.arrive_every))
    rows = {}
    for name, rs in runs.items():
        rows[name] = dict(wall_s=round(statistics.median(r["wall_s"] for r in rs), 4),
                          forwards=rs[0]["forwards"], steps=rs[0]["steps"], both_steps=rs[0]["both_steps"],
                          both_step_ms=round(statistics.median(r["both_step_ms"] for r in rs), 3)
                          if rs[0]["both_step_ms"] is not None else None)
        _log(f"{name}: {rows[name]}")
    equal = all(r["outputs"] == runs["apart"][0]["outputs"] for rs in runs.values() for r in rs)
    result = dict(device=str(dev), ckpt=args.ckpt, requests=args.requests, prompt_tokens=args.prompt_tokens,
                  max_tokens=args.max_tokens, arrive_every=args.arrive_every, arms=rows, outputs_equal=equal,
                  speedup_wall=round(rows["apart"]["wall_s"] / rows["mixed"]["wall_s"], 3))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not equal:
        raise SystemExit("the two arms' outputs differ: mixing must not change greedy output")


if __name__ == "__main__":
    main()
