"""Run the GPU tests and the GPU benchmarks in one go, each step with its own time limit and log.

    python benchmarks/gpu_suite.py --out gpu-results [--steps tests ops train ...] [--budget-s 560] \
        [--load-cache kernels.tar.gz] [--save-cache kernels.tar.gz --split-mb 15]

Steps run in the order given (default: all, most important first). Each step is a separate process whose
output is streamed to the terminal and to OUT/<step>.log, so a step that hangs or runs out of time loses only
itself. Compiled Triton kernels, their autotuning results and torch.compile's kernels are cached under
OUT/cache (TRITON_CACHE_DIR with TRITON_CACHE_AUTOTUNING=1, TORCHINDUCTOR_CACHE_DIR): a second run on the same machine, or with that folder
copied to another machine of the same kind, skips most of the first-call compilation (several minutes for
fla's KDA kernels on a fresh machine, almost all of it autotuning). `--save-cache` packs that folder's
autotuning results (or, with `--cache-content all`, every compiled kernel) into a .tar.gz (in numbered parts of
at most `--split-mb` MB when asked) and `--load-cache` unpacks such an archive (or its parts) before the steps.
A summary line per step (exit status, seconds) ends the output.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import subprocess
import sys
import tarfile
import threading
import time

PY = sys.executable
GPU_TEST_FILES = [  # quick kernels
    "tests/ops/test_attn_res.py",
    "tests/ops/test_situ_triton.py",
    "tests/ops/test_moe_grouped.py",
    "tests/ops/test_moe_combine.py",
    "tests/ops/test_mx_moe.py",
    "tests/ops/test_mx_moe_grouped.py",
    "tests/ops/test_mx_triton.py",
    "tests/serve/speculative/test_replay.py",
    "tests/serve/speculative/test_spec_graphs.py",
    "tests/ops/test_mla_decode.py",
    "tests/serve/test_cuda_graphs.py",
    "tests/model/test_stack_projections.py",
    "tests/ops/test_mla_flex.py",
    "tests/train/test_per_head_muon.py",
    "tests/ops/test_muon_update.py",
    "tests/ops/test_gate_norm.py",
    "tests/ops/test_linear_ce.py",
    "tests/ops/test_rms_norm.py",
    "tests/ops/test_kda_decode.py",
    "tests/ops/test_moe_route.py",
    "tests/ops/test_vision_attn.py",
    "tests/model/test_vision_reference.py",
    "tests/train/test_long_eval.py",
    "tests/serve/test_images_serve.py",
    "tests/ops/test_kda_verify_replay.py",
    "tests/serve/speculative/test_fused_replay.py",
    "tests/ops/test_attn_res_norm.py",
    "tests/ops/test_mla_out.py",
    "tests/ops/test_moe_gemv.py",
    "tests/ops/test_mla_append.py",
    "tests/ops/test_rms_norm_pair.py",
]
# fla's KDA kernels compile and autotune for minutes on a fresh machine (per shape): a step of their own
KDA_TEST_FILES = ["tests/ops/test_kda_backend.py", "tests/parallel/test_context_parallel.py"]
# every fast backend inside k3-mini against the reference, site by site (one case per backend, then all at once)
MODEL_TEST_FILE = "tests/model/test_fast_backends_gpu.py"
PYTEST = [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--tb=short", "-rs"]
# -v names each test as it starts (a step stopped by its time limit shows where); -s lets autotuning print its time
KDA_PYTEST = ["env", "TRITON_PRINT_AUTOTUNING=1"] + [a for a in PYTEST if a != "-q"] + ["-v", "-s"]
TRAIN = [PY, "benchmarks/train_throughput.py", "--preset", "k3-mini", "--batch-tokens", "32768", "--steps", "4",
         "--vocab-size", "32768", "--backend", "fast"]

# the fused decode-step kernels pinned off (torch: the composed ops) and on (triton)
_FUSED = ("KDA_DECODE", "MOE_ROUTE", "ATTN_RES_NORM", "MLA_ABSORB_V", "MLA_GATE", "MOE_GEMV", "MOE_COMBINE_NORM",
          "RMS_NORM_PAIR", "KDA_DECODE_DECAY_PROJ", "MLA_APPEND", "MOE_ROUTE_ROUND",
          "MOE_OUT", "MLA_COMBINE_ABSORB_V", "MOE_COMBINE_NORM_OUT")
_FUSED_OFF = ["env"] + [f"K3_{op}_BACKEND=torch" for op in _FUSED]
_FUSED_ON = ["env"] + [f"K3_{op}_BACKEND=triton" for op in _FUSED]
_KERNELS = [PY, "benchmarks/decode_ops.py", "--preset", "k3-mini", "--kernels", "--backend", "fast",
            "--stack-projections", "on"]
_DECODE = [PY, "benchmarks/serve_bench.py", "--preset", "k3-mini", "--ttft", "--decode-batch", "1", "16", "64",
           "--backend", "fast"]

# name -> (commands, time limit in seconds for the whole step)
COMPILE_TEST_FILE = "tests/serve/test_cuda_graphs.py"
STEPS = {
    # flex max-autotune compiles for a minute or two; the compiled decode step's test has a step of its own
    "tests": ([PYTEST + [f] + (["-k", "not compiled_captured"] if f == COMPILE_TEST_FILE else [])
               for f in GPU_TEST_FILES], 520),
    # torch.compile of the decode step (EngineConfig.compile_decode): Inductor's compiles, one per bucket
    "tests_compile_decode": ([PYTEST + ["-k", "compiled_captured", COMPILE_TEST_FILE]], 420),
    # every task's GPU expert on every case in-process (fla compiles and autotunes each held-out shape)
    "tests_kernel_reward": ([PYTEST + ["tests/kernel_reward/test_tasks.py"]], 420),
    "tests_kda": ([KDA_PYTEST + ["-k", "not fp32", f] for f in KDA_TEST_FILES], 480),
    # then the ablation arms' forwards at k3-mini shapes on the same fast backends (their kernels compiled by then)
    "tests_model": ([[a for a in PYTEST if a != "-q"] + ["-v", MODEL_TEST_FILE],
                     [a for a in PYTEST if a != "-q"] + ["-v", "tests/model/test_ablations_gpu.py"]], 540),
    # fla's chunk lists from host offsets (Backends.kda_host_offsets): the KDA and conv op tests of that form, the
    # in-situ model case and the check that a training forward + backward never waits for the device
    "tests_host_offsets": ([KDA_PYTEST + ["-k", "host or together", KDA_TEST_FILES[0]],
                            [a for a in PYTEST if a != "-q"] + ["-v", "-k", "host_offsets or never_wait",
                                                                MODEL_TEST_FILE]], 480),
    # fp32 inputs are a new autotuning set for every fla kernel (about 7 minutes on a fresh machine)
    "tests_kda_fp32": ([KDA_PYTEST + ["-k", "fp32", KDA_TEST_FILES[0]]], 540),
    "train8k": ([TRAIN + ["--seq-len", "8192", "--micro-batch-rows", "4"]], 150),
    # the trace is also broken down right there (returned files are size-limited; the report is text in the log)
    "train8k_profile": ([TRAIN + ["--seq-len", "8192", "--micro-batch-rows", "4", "--profile",
                                  "--trace", "{out}/trace8k.json.gz"],
                         [PY, "benchmarks/trace_report.py", "{out}/trace8k.json.gz", "--top", "6"]], 240),
    # the same micro-batches, 8 per optimizer step (262,144 tokens): the optimizer's cost spread over more tokens
    "train8k_256k": ([[PY, "benchmarks/train_throughput.py", "--preset", "k3-mini", "--batch-tokens", "262144",
                       "--steps", "3", "--vocab-size", "32768", "--backend", "fast", "--seq-len", "8192",
                       "--micro-batch-rows", "4"]], 240),
    # 1,048,576 tokens per optimizer step (32 micro-batches): the optimizer's share down to ~1%
    "train8k_1m": ([[PY, "benchmarks/train_throughput.py", "--preset", "k3-mini", "--batch-tokens", "1048576",
                     "--steps", "1", "--continuous-steps", "1", "--vocab-size", "32768", "--backend", "fast",
                     "--seq-len", "8192", "--micro-batch-rows", "4"]], 240),
    "train8k_ref": ([TRAIN[:-1] + ["torch", "--seq-len", "8192", "--micro-batch-rows", "4"]], 150),
    "qat": ([[PY, "benchmarks/qat_overhead.py", "--preset", "k3-mini", "--seq-len", "4096", "--batch-tokens", "32768",
              "--vocab-size", "32768", "--backend", "fast"]], 300),
    "optim": ([[PY, "benchmarks/optimizer_bench.py", "--preset", "k3-mini", "--backend", b] for b in ("torch", "fast")],
              150),
    "ops": ([[PY, "benchmarks/situ_bench.py"], [PY, "benchmarks/ops_bench.py"],
             [PY, "benchmarks/mla_decode_bench.py"], [PY, "benchmarks/mx_moe_layer.py"],
             [PY, "benchmarks/kda_replay_bench.py"]], 300),
    # the SiTU-GLU kernel alone: its GPU tests, then its bandwidth against a copy
    "situ": ([PYTEST + ["tests/ops/test_situ_triton.py"], [PY, "benchmarks/situ_bench.py"]], 300),
    # the flex MLA kernels' block sizes, one compile per configuration (~10 s each)
    "flex_tune": ([[PY, "benchmarks/flex_tune.py"]], 300),
    "train4k": ([TRAIN + ["--seq-len", "4096", "--micro-batch-rows", "8"]], 120),
    "train32k": ([TRAIN + ["--seq-len", "32768", "--micro-batch-rows", "1", "--activation-checkpointing"]], 150),
    # 32K context without recomputation (one 32K-token row per micro-batch needs about the memory of four 8K rows),
    # 8 micro-batches per optimizer step; and the reference path at 32K for the ratio (one step, recomputing)
    "train32k_256k": ([[PY, "benchmarks/train_throughput.py", "--preset", "k3-mini", "--batch-tokens", "262144",
                        "--steps", "2", "--vocab-size", "32768", "--backend", "fast", "--seq-len", "32768",
                        "--micro-batch-rows", "1"]], 240),
    "train32k_ref": ([[PY, "benchmarks/train_throughput.py", "--preset", "k3-mini", "--batch-tokens", "32768",
                       "--steps", "1", "--continuous-steps", "0", "--vocab-size", "32768", "--backend", "torch",
                       "--seq-len", "32768", "--micro-batch-rows", "1", "--activation-checkpointing"]], 300),
    "long": ([[PY, "benchmarks/long_context.py", "--preset", "k3-mini", "--seq-len", "131072"]], 180),
    # the GPU tests of the decode-step kernels not yet validated (the fused AttnRes sites, the MLA append, absorption
    # and gate, the MoE GEMV), and one captured step with every fused decode kernel against the composed ops
    "decode_kernels": ([PYTEST + ["tests/ops/test_attn_res_norm.py", "tests/ops/test_mla_out.py",
                                  "tests/ops/test_moe_gemv.py", "tests/ops/test_mla_append.py",
                                  "tests/ops/test_rms_norm_pair.py", "tests/ops/test_kda_decode.py",
                                  "tests/ops/test_moe_route.py", "tests/ops/test_moe_out.py"],
                        PYTEST + [COMPILE_TEST_FILE, "-k", "fused_decode_kernels"]], 480),
    # the fused KDA decode step and router kernel, the fused replay, the draft's captured chains and verifying ahead:
    # their GPU tests (about 8 minutes on a fresh machine, most of it compiling)
    "decode_fused": ([PYTEST + ["tests/ops/test_kda_decode.py", "tests/ops/test_moe_route.py",
                                "tests/ops/test_kda_verify_replay.py", "tests/ops/test_kda_verify_step.py",
                                "tests/serve/speculative/test_fused_replay.py",
                                "tests/serve/speculative/test_batched_draft.py",
                                "tests/serve/speculative/test_verify_ahead.py"]], 560),
    # decode with every fused decode kernel on and off, side by side (the first pass compiles: about 2 minutes on a
    # fresh machine), then kernels per layer on and off
    "decode_bench": ([_FUSED_ON + _DECODE, _FUSED_OFF + _DECODE, _FUSED_ON + _KERNELS, _FUSED_OFF + _KERNELS], 540),
    # where a batch-1 decode step's time goes (the profiler's kernels of captured steps, `auto`'s kernels) and the
    # step's sampling and logprobs by arm, with its costliest kernels (seeded as an RL rollout, then unseeded)
    "decode_profile": ([[PY, "benchmarks/serve_bench.py", "--preset", "k3-mini", "--decode-batch", "1", "--backend",
                         "fast", "--profile"],
                        [PY, "benchmarks/sampling_bench.py", "--batch", "1", "16", "64", "--top-kernels", "6"],
                        [PY, "benchmarks/sampling_bench.py", "--batch", "1", "64", "--unseeded"]], 400),
    # the MoE GEMV kernels' tile shapes side by side (what picks their block sizes)
    "moe_gemv_tune": ([[PY, "benchmarks/moe_gemv_tune.py"]], 300),
    "serve": ([[PY, "benchmarks/serve_bench.py", "--preset", "k3-mini", "--ttft", "8192", "32768", "--decode-batch",
                "1", "16", "64", "--backend", "fast"]], 300),
    # speculative decoding on a trained k3-mini (one command each, on the same machine: runs/spec_gpu stays there).
    # On a fresh machine the first start takes ~5 minutes before training time is counted (H100, 2026-12-07: 34 s
    # data and model, 90 s the first held-out evaluation compiling flex_attention, 189 s the first step compiling;
    # none of it counts in --max-minutes), so spec_train trains 2.5 minutes and spec_train_more (--resume: the budget
    # counts across resumes, so 7 more) the rest, each with its save inside the step's limit, before spec
    "spec_train": ([[PY, "-m", "k3", "train", "--out", "runs/spec_gpu", "--max-minutes", "2.5", "--eval-batches", "2",
                     "--no-progress"]], 560),
    "spec_train_more": ([[PY, "-m", "k3", "train", "--out", "runs/spec_gpu", "--resume", "--max-minutes", "9.5",
                          "--eval-batches", "8", "--no-progress"]], 560),
    "spec": ([[PY, "benchmarks/spec_decode.py", "--ckpt", "runs/spec_gpu", "--batch", "1", "4", "16", "64",
               "--max-tokens", "128", "--replay-after", "--stage-times", "--stage-kernels", "8", "--json",
               "{out}/spec.json"]], 560),
    # the speculative cycle at full acceptance without training (a random k3-mini whose draft is made always right,
    # spec_decode --right-draft): drafting after, ahead (the default) and verifying ahead side by side, batch 1 with
    # the stages timed, then batch 64 (the first run on a fresh machine compiles: about 2 minutes)
    "spec_right": ([[PY, "-m", "k3", "init", "--preset", "k3-mini", "--tokenizer", "bytes", "--out",
                     "runs/random_mini"],
                    [PY, "benchmarks/spec_decode.py", "--ckpt", "runs/random_mini", "--batch", "1", "--max-tokens",
                     "96", "--prompt-tokens", "128", "--right-draft", "--draft-after", "--verify-ahead", "--no-auto",
                     "--stage-times", "--json", "{out}/spec_right_b1.json"],
                    [PY, "benchmarks/spec_decode.py", "--ckpt", "runs/random_mini", "--batch", "64", "--max-tokens",
                     "48", "--prompt-tokens", "128", "--right-draft", "--draft-after", "--verify-ahead", "--no-auto",
                     "--json", "{out}/spec_right_b64.json"]], 560),
}


def run_step(name: str, cmds: list, limit: float, out: str, env: dict) -> tuple[int, float]:
    """Run a step's commands one after another ("{out}" in an argument becomes the --out folder), each line also
    written to OUT/<name>.log, within `limit` seconds for the whole step."""
    t0 = time.monotonic()
    rc = 0
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        for cmd in cmds:
            cmd = [a.replace("{out}", out) for a in cmd]
            left = limit - (time.monotonic() - t0)
            if left <= 5:
                print(f"[{name}] out of time before: {' '.join(cmd)}", flush=True)
                return 124, time.monotonic() - t0
            print(f"[{name}] $ {' '.join(cmd)}", flush=True)
            log.write(f"$ {' '.join(cmd)}\n")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
            watchdog = threading.Timer(left, proc.kill)  # a silent hang is stopped too
            watchdog.start()
            for line in proc.stdout:
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()
                log.write(line)
                log.flush()
            code = proc.wait()
            watchdog.cancel()
            if time.monotonic() - t0 >= limit - 1:
                print(f"[{name}] time limit reached, stopped", flush=True)
                return 124, time.monotonic() - t0
            rc = max(rc, code)
    return rc, time.monotonic() - t0


def save_cache(cache: str, path: str, split_mb: float | None, content: str = "autotune") -> list[str]:
    """Pack `cache` into `path` (.tar.gz); with `split_mb`, into path.part00, path.part01, ... instead.

    content "autotune" packs only Triton's autotuning results (*.autotune.json, a few hundred kB): with them
    a new machine compiles just the chosen configuration of each kernel instead of benchmarking all of them.
    "all" packs the compiled kernels too (hundreds of MB)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        if content == "all":
            tar.add(cache, arcname="cache")
        else:
            for root, _, files in os.walk(cache):
                for f in sorted(files):
                    if f.endswith(".autotune.json"):
                        full = os.path.join(root, f)
                        tar.add(full, arcname=os.path.join("cache", os.path.relpath(full, cache)))
    data = buf.getvalue()
    if not split_mb:
        parts = [(path, data)]
    else:
        size = int(split_mb * 2**20)
        parts = [(f"{path}.part{i:02d}", data[o:o + size]) for i, o in enumerate(range(0, len(data), size))]
    for name, chunk in parts:
        tmp = name + ".tmp"
        with open(tmp, "wb") as f:
            f.write(chunk)
        os.replace(tmp, name)
    return [name for name, _ in parts]


def load_cache(path: str, out: str) -> None:
    """Unpack an archive written by `save_cache` (whole, or its .partNN files) into `out`."""
    names = [path] if os.path.exists(path) else sorted(glob.glob(glob.escape(path) + ".part*"))
    if not names:
        raise SystemExit(f"--load-cache {path}: no such archive (nor {path}.partNN files)")
    data = b"".join(open(n, "rb").read() for n in names)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(out, filter="data")


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the logs and the kernel cache")
    ap.add_argument("--steps", nargs="*", default=list(STEPS), choices=list(STEPS))
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting steps after this many seconds")
    ap.add_argument("--load-cache", help="unpack a kernel-cache archive from --save-cache before the steps")
    ap.add_argument("--save-cache", help="pack OUT/cache into this .tar.gz after the steps")
    ap.add_argument("--split-mb", type=float, default=None, help="with --save-cache: parts of at most this size")
    ap.add_argument("--cache-content", choices=["autotune", "all"], default="autotune",
                    help="with --save-cache: only Triton's autotuning results (default, small) or every compiled kernel")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.load_cache:
        load_cache(args.load_cache, args.out)
    cache = os.path.abspath(os.path.join(args.out, "cache"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_AUTOTUNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    t_start = time.monotonic()
    summary, saved = [], []
    for name in args.steps:
        cmds, limit = STEPS[name]
        if args.budget_s is not None:
            left = args.budget_s - (time.monotonic() - t_start)
            if left < 30:
                summary.append((name, "skipped (budget)", 0.0))
                continue
            limit = min(limit, left)
        rc, dt = run_step(name, cmds, limit, args.out, env)
        summary.append((name, f"exit {rc}", dt))
        if args.save_cache and args.cache_content == "autotune" and os.path.isdir(cache):
            saved = save_cache(cache, args.save_cache, args.split_mb, "autotune")  # small: kept current every step
    for name, status, dt in summary:
        print(f"SUMMARY {name}: {status} in {dt:.0f} s", flush=True)
    if args.save_cache and os.path.isdir(cache) and (args.cache_content == "all" or not saved):
        saved = save_cache(cache, args.save_cache, args.split_mb, args.cache_content)
    for name in saved:
        print(f"kernel cache: {name} ({os.path.getsize(name) / 2**20:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
