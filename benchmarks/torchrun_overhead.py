"""The cost of launching `k3 train` under torchrun with one process, against the plain single-device trainer.

    python benchmarks/torchrun_overhead.py --preset k3-mini --steps 20 --skip 5 --repeats 2 \
        [--seq-len 4096 --batch-tokens 32768] [--json OUT.json] [-- EXTRA k3 train FLAGS]

Under torchrun, even with one process, `k3 train` runs the distributed trainer: the model sharded by FSDP2 over a
one-rank mesh (bf16 compute through FSDP2's mixed-precision policy instead of the single-device trainer's autocast
weight casts), the process group (NCCL on CUDA), and the sharded training state in each checkpoint. This runs both
commands with the same flags, alternating plain / torchrun `--repeats` times so that drift of the machine falls on
both, and compares the median tokens/s (the same tokens per step: step time) of the steps after the first `--skip` (warm-up, autotuning) from each
run's metrics.jsonl. Start-up (corpus, tokenizer, model build) and the final checkpoint are not in the step time;
the wall time of each command is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens_per_s(run: str, skip: int) -> list[float]:
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in recs if "tokens_per_s" in r and r.get("step", 0) > skip]
    return [r["tokens_per_s"] for r in steps]


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more `k3 train` flags (after --)")
    a = ap.parse_args()
    if a.steps <= a.skip:
        raise SystemExit(f"--steps {a.steps} must exceed --skip {a.skip}")
    flags = ["train", "--preset", a.preset, "--max-steps", str(a.steps), "--eval-every", "100000", "--no-progress",
             "--device", a.device]
    if a.seq_len:
        flags += ["--seq-len", str(a.seq_len)]
    if a.batch_tokens:
        flags += ["--batch-tokens", str(a.batch_tokens)]
    flags += a.extra
    work = tempfile.mkdtemp(prefix="k3-torchrun-overhead-")
    env = dict(os.environ)
    env.pop("TORCHELASTIC_RUN_ID", None)
    results: dict[str, list] = {"plain": [], "torchrun": []}
    try:
        for rep in range(a.repeats):
            for kind in ("torchrun", "plain"):  # the distributed path first: it is the one that may fail
                out = os.path.join(work, f"{kind}-{rep}")
                cmd = [sys.executable, "-m", "k3"] + flags + ["--out", out]
                if kind == "torchrun":
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
                           "127.0.0.1", "--master-port", str(_free_port()), "-m", "k3"] + flags + ["--out", out]
                t0 = time.perf_counter()
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if done.returncode != 0:
                    raise SystemExit(f"{kind} run {rep} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
                tps = _tokens_per_s(out, a.skip)
                med = statistics.median(tps)
                results[kind].append({"tokens_per_s_median": med, "steps_timed": len(tps), "wall_s": wall})
                print(f"{kind:9s} run {rep}: median {med:12,.0f} tokens/s over {len(tps)} steps, "
                      f"wall {wall:6.1f} s", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plain = statistics.median(r["tokens_per_s_median"] for r in results["plain"])
    launched = statistics.median(r["tokens_per_s_median"] for r in results["torchrun"])
    overhead = plain / launched - 1  # step time of torchrun over plain, minus one (same tokens per step)
    print(f"\nplain {plain:,.0f} tokens/s, torchrun 1 process {launched:,.0f} tokens/s: step-time overhead "
          f"{overhead * 100:+.2f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"flags": flags, "runs": results, "plain_tokens_per_s": plain, "torchrun_tokens_per_s": launched,
                       "overhead": overhead}, f, indent=2)


if __name__ == "__main__":
    main()
