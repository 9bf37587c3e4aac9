"""Serving measurements of the engine: time to first token with and without a prefix-cache hit, and decode
speed at several batch sizes against the memory-bandwidth floor.

    python benchmarks/serve_bench.py --preset k3-mini --ttft 8192 32768 --decode-batch 1 16 64 [--backend fast]
    python benchmarks/serve_bench.py --preset k3-mini --ttft --decode-batch 1 16 64 --backend fast --compile-decode both

TTFT: a first request primes the cache with the first N-512 tokens of a prompt; a second request sends the
full N-token prompt, so all but its last 512 tokens are cached. "cold" is the same prompt on an engine
without the prefix cache. Each measurement is repeated on a fresh prompt and the repeat is reported (the first
pass compiles and autotunes the kernels), and the cached engine first serves an untimed cached request on another
prompt (which captures its prefill CUDA graph); decode is timed after warm-up steps that capture its graphs. Decode floor: bytes read per step (all non-routed weights, the routed experts the
batch can touch, KDA state read + write, MLA latent cache read) over 4.0 TB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import time

import torch

from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

COPY_BW = 4.0e12
PROFILE = False  # --profile: print where the time of each timed region goes


@contextlib.contextmanager
def _maybe_profile(label: str, dev):
    """With --profile, run the block under torch.profiler and cProfile and print its top operators by device time
    (CUDA) and by host time, and the Python functions by cumulative host time."""
    if not PROFILE:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    py = cProfile.Profile()
    with profile(activities=acts) as prof:
        py.enable()
        yield
        py.disable()
    print(f"--- profile: {label} ---")
    if dev.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    print(f"--- Python functions (cumulative host time): {label} ---")
    out = io.StringIO()
    pstats.Stats(py, stream=out).sort_stats("cumulative").print_stats(25)
    print(out.getvalue())


def _engine(model, enable, mb, chunk, compile_decode=False, stack=True):
    sched = SchedulerConfig(max_step_tokens=chunk, prefill_chunk=chunk, max_num_seqs=128, long_prompt_tokens=10**9)
    e = LLMEngine(model, None, EngineConfig(cache_memory_mb=mb, enable_prefix_cache=enable,
                                            compile_decode=compile_decode, stack_projections=stack, scheduler=sched))
    e.eos_id = None
    return e


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def ttft(model, n, dev, mb, chunk) -> dict:
    """Cold vs cached TTFT of an n-token prompt. The whole measurement runs twice on different prompts and the
    second is reported, so first-call kernel compilation and autotuning are not timed."""
    for rep in range(2):
        res = _ttft_once(model, n, dev, mb, chunk, seed=n + rep)
    if PROFILE:  # a third, untimed pass under the profiler
        _ttft_once(model, n, dev, mb, chunk, seed=n + 2, profile=True)
    return res


def _ttft_once(model, n, dev, mb, chunk, seed, profile=False) -> dict:
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt = torch.randint(1, V, (n,), generator=g).tolist()
    one = SamplingParams(max_tokens=1, temperature=0)
    res = {}
    for enable in (False, True):
        eng = _engine(model, enable, mb, chunk)
        if enable:
            # An untimed cached request on another prompt first: it captures the engine's hash-block prefill graph
            # (on CUDA), which would otherwise be captured inside the timed request.
            other = torch.randint(1, V, (n,), generator=g).tolist()
            eng.generate([other[: n - 512] + [1]], one)
            eng.generate([other], one)
            eng.generate([prompt[: n - 512] + [1]], one)  # primes the cache up to the boundary at n - 512
        _sync(dev)
        t0 = time.perf_counter()
        with _maybe_profile(f"TTFT {n} tokens, {'cached' if enable else 'cold'}", dev) if profile else \
                contextlib.nullcontext():
            s = eng.generate([prompt], one)[0]
            _sync(dev)
        res["cached" if enable else "cold"] = {"ttft_s": round(time.perf_counter() - t0, 4),
                                               "cached_tokens": s.cached_tokens, "first_token": s.output_ids[0]}
    res["speedup"] = round(res["cold"]["ttft_s"] / res["cached"]["ttft_s"], 2)
    # greedy: the cached path (restored state, captured graphs) should pick the cold run's token; in bf16 a near-tie
    # of the top two logits may still differ, so this is reported, not asserted (the exactness tests assert it)
    res["same_first_token"] = res["cold"]["first_token"] == res["cached"]["first_token"]
    return res


def decode(model, batch, dev, mb, ctx=1024, steps=32, compile_decode=False, stack=True) -> dict:
    cfg = model.config
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, V, (ctx,), generator=g).tolist() for _ in range(batch)]
    eng = _engine(model, False, mb, 8192, compile_decode, stack)
    p = SamplingParams(max_tokens=steps + 100, temperature=0)  # every request runs through the timed steps
    seqs = [eng.add_request(pr, p) for pr in prompts]
    while any(len(s.output_ids) < 4 for s in seqs):  # prefill, then two decode steps (graph capture) as warm-up
        eng.step()
    _sync(dev)
    graphs = eng.runner.graphs
    replays0 = graphs.replays if graphs is not None else 0
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(dev)
    dt = (time.perf_counter() - t0) / steps
    replayed = (graphs.replays - replays0) if graphs is not None else 0  # timed steps that replayed a graph
    with _maybe_profile(f"decode, batch {batch}, 4 steps", dev):
        for _ in range(4):
            eng.step()
        _sync(dev)
    wbytes = 2  # bf16 weights
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    other = sum(p.numel() for n, p in model.named_parameters()
                if ".experts." not in n and not n.startswith(("mtp.", "vision.")))
    touched = min(1.0, batch * cfg.num_experts_per_token / cfg.num_experts)
    n_kda = len(cfg.kda_layers)
    state = n_kda * cfg.kda_num_heads * cfg.kda_head_dim**2 * 4 * 2 * batch
    mla = len(cfg.full_attn_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * ctx * batch
    floor = (wbytes * (other + routed * touched) + state + mla) / COPY_BW
    compiled = "failed: " + graphs.compile_failed if graphs is not None and graphs.compile_failed else compile_decode
    return {"batch": batch, "compile_decode": compiled, "stack_projections": stack, "step_ms": round(dt * 1e3, 3),
            "graph_replays": f"{replayed}/{steps}", "tokens_per_s": round(batch / dt, 1), "floor_ms": round(floor * 1e3, 4),
            "fraction_of_floor": round(floor / dt, 4)}


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ttft", type=int, nargs="*", default=[2048])
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--compile-decode", choices=["off", "on", "both"], default="off",
                    help="torch.compile the static decode step before capture (EngineConfig.compile_decode); both: "
                         "each decode batch size without and with it")
    ap.add_argument("--stack-projections", choices=["off", "on", "both"], default="on",
                    help="each layer's projections of one input as one GEMM (EngineConfig.stack_projections); both: "
                         "each decode batch size without and with it")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--cache-mb", type=float, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto",
                    help="fast: every op on its GPU fast path (incl. the paged decode kernel, which enables decode "
                         "CUDA graphs); torch: the reference ops; auto: k3.ops.registry decides")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler tables for one more (untimed) TTFT pass and 4 more decode steps")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    from k3.ops.registry import backends_from_env

    backends = backends_from_env(os.environ, default=args.backend)
    dev = torch.device(args.device)
    cfg = K3Config.from_preset(args.preset).replace(num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg, backends=backends).init_weights(seed=0)
    if dev.type == "cuda":
        model = model.set_dtype(torch.bfloat16)
    model = model.to(dev).eval()
    for n in args.ttft:
        print(json.dumps({"preset": args.preset, "prompt_tokens": n, **ttft(model, n, dev, args.cache_mb, args.chunk)}))
    choices = {"off": [False], "on": [True], "both": [False, True]}
    for b in args.decode_batch:  # with "both": without and with, side by side per batch size
        for comp in choices[args.compile_decode]:
            for stack in choices[args.stack_projections]:
                print(json.dumps({"preset": args.preset, "per_op": backends.per_op,
                                  **decode(model, b, dev, args.cache_mb, compile_decode=comp, stack=stack)}),
                      flush=True)


if __name__ == "__main__":
    main()
