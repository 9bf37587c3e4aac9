"""The report's training claims at small scale, arm by arm on the same data and token budget (report §2.3.3, §2.5,
§3.3): Quantile Balancing vs the sign update vs no balancing; Per-Head Muon vs whole-matrix Muon vs AdamW; QK-Clip
on vs off at a learning rate where logits grow.

    python benchmarks/training_claims.py --out runs/claims                              # CPU: tiny, a smoke study
    python benchmarks/training_claims.py --out runs/claims --preset k3-mini --steps 300 --seq-len 4096 \
        --batch-tokens 32768 --arms qb sign                                             # one GPU, a few arms a call

Arms (each a `k3 train` run, k3.train.run.run_training in-process, under OUT/<arm>; an arm whose metrics.jsonl
already has --steps steps is read, not rerun, so a study can be split over several calls):

    qb        Quantile Balancing (histogram), Per-Head Muon, QK-Clip at tau 100: K3's setting, the reference arm
    sign      the sign update of auxiliary-loss-free balancing (step 1e-3) instead of QB
    none      no balancing
    muon      whole-matrix Muon (Q, K, V orthogonalized whole) instead of Per-Head Muon
    adamw     AdamW for every parameter
    clip      QK-Clip at tau 100 with --clip-lr (a learning rate where max logits grow)
    noclip    the same without QK-Clip (tau 1e30: never clips, still measures the max logits)

The balance arms log `--balance-diagnostics` (the same-batch ideal imbalance and the experts without tokens). Per
arm: final training loss (mean of the last 10% of steps), best and final held-out loss, busiest/mean expert load
(median over layers of the mean over the last half of the steps; routed, and the same-batch ideal), experts without
tokens (mean per layer and step over the last half), the largest MLA max logit. Writes OUT/claims.json, a Markdown
table (printed, and OUT/claims.md) and three plots (OUT/balance.png, OUT/optimizers.png, OUT/qk_clip.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

ARMS = {
    "qb": dict(balance="histogram", balance_diagnostics=True),
    "sign": dict(balance="sign", balance_diagnostics=True),
    "none": dict(balance="none", balance_diagnostics=True),
    "muon": dict(optimizer="muon"),
    "adamw": dict(optimizer="adamw"),
    "clip": dict(qk_clip_tau=100.0, lr="clip"),
    # tau so high it never clips: the max logits are still measured (tau 0 would switch the measurement off too)
    "noclip": dict(qk_clip_tau=1e30, lr="clip"),
}


def _log(msg: str) -> None:
    print(f"[claims {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _records(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_arm(name: str, args) -> list[dict]:
    from k3.train.run import RunOptions, run_training
    from k3.train.trainer import TrainConfig

    from k3.train.trainer import TrainingError

    out = os.path.join(args.out, name)
    recs = _records(out)
    if sum(1 for r in recs if "loss" in r) >= args.steps or os.path.isfile(os.path.join(out, "diverged.txt")):
        _log(f"{name}: read from {out}")
        return recs
    if os.path.isdir(out):
        shutil.rmtree(out)  # an unfinished arm starts again (same seed, same data)
    kw = dict(ARMS[name])
    lr = args.clip_lr if kw.pop("lr", None) == "clip" else args.lr
    tcfg = TrainConfig(out=out, max_steps=args.steps, seq_len=args.seq_len, batch_tokens=args.batch_tokens, lr=lr,
                       seed=args.seed, eval_every=max(1, args.steps // 10), eval_batches=args.eval_batches,
                       save_checkpoints=False, device=args.device_resolved,
                       autocast_bf16=args.device_resolved.startswith("cuda"), **kw)
    _log(f"{name}: {kw} lr {lr}")
    shared_tok = os.path.join(args.out, "tokenizer.json")  # every arm reads the same tokens: train the BPE once
    if os.path.isfile(shared_tok):
        os.makedirs(out, exist_ok=True)
        shutil.copyfile(shared_tok, os.path.join(out, "tokenizer.json"))
    try:
        run_training(RunOptions(preset=args.preset, data=args.data or [], device=args.device,
                                vocab_size=args.vocab_size, data_cache=os.path.join(args.out, "data")),
                     tcfg, progress_bar=False, log=lambda *a: None)
    except TrainingError as e:  # a diverged arm is a result (QK-Clip off at a high learning rate may diverge)
        _log(f"{name}: diverged: {e}")
        with open(os.path.join(out, "diverged.txt"), "w") as f:
            f.write(f"{e}\n")
        return _records(out)
    if not os.path.isfile(shared_tok):
        shutil.copyfile(os.path.join(out, "tokenizer.json"), shared_tok)
    recs = _records(out)
    done = sum(1 for r in recs if "loss" in r)
    if done < args.steps:  # stopped by a signal (the trainer saves and returns): the study stops here
        raise SystemExit(f"arm {name} stopped at step {done} of {args.steps}; run the same command again to redo it "
                         "and go on (finished arms are read, not rerun)")
    return recs


def _mean(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.fmean(xs) if xs else float("nan")


def summarize(name: str, recs: list[dict], diverged: bool = False) -> dict:
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "val_loss" in r]
    tail = steps[len(steps) // 2:]
    last = steps[-max(1, len(steps) // 10):]

    def per_layer(key):
        rows = [r[key] for r in tail if r.get(key)]
        if not rows:
            return float("nan")
        return statistics.median(_mean(col) for col in zip(*rows))

    return dict(arm=name, steps=len(steps), diverged=diverged, train_loss=round(_mean(r["loss"] for r in last), 4),
                val_loss_best=round(min(r["val_loss"] for r in evals), 4) if evals else None,
                val_loss_final=round(evals[-1]["val_loss"], 4) if evals else None,
                load_max_over_mean=round(per_layer("expert_load_max_over_mean"), 3),
                ideal_load_max_over_mean=round(per_layer("expert_load_ideal_max_over_mean"), 3),
                experts_without_tokens=round(per_layer("experts_without_tokens"), 2),
                max_logit=round(max((r.get("max_logit") or 0.0) for r in steps), 1) if steps else None)


def plot(results: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(recs, key, agg=max):
        xs, ys = [], []
        for r in recs:
            v = r.get(key)
            if v is None or v == []:  # an arm without balancers logs no loads
                continue
            xs.append(r["step"])
            ys.append(agg(v) if isinstance(v, list) else v)
        return xs, ys

    groups = {"balance.png": (["qb", "sign", "none"], [("loss", "training loss", None),
                                                       ("expert_load_max_over_mean", "busiest / mean load "
                                                        "(worst layer)", max)]),
              "optimizers.png": (["qb", "muon", "adamw"], [("loss", "training loss", None),
                                                           ("val_loss", "held-out loss", None)]),
              "qk_clip.png": (["clip", "noclip"], [("max_logit", "largest MLA logit", None),
                                                  ("loss", "training loss", None)])}
    for fname, (arms, panels) in groups.items():
        arms = [a for a in arms if a in results]
        if not arms:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
        for ax, (key, title, agg) in zip(axes, panels):
            for a in arms:
                xs, ys = series(results[a], key, agg or (lambda v: v))
                ax.plot(xs, ys, label=a)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        plt.close(fig)


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--preset", default=None, help="default: tiny on CPU, k3-mini on a GPU")
    ap.add_argument("--data", action="append", help="as k3 train --data (default: the default corpus)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=None, help="default: k3 train's for the device")
    ap.add_argument("--clip-lr", type=float, default=2e-2, help="learning rate of the clip / noclip arms")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    from k3.devices import pick_device
    from k3.train.run import CPU_DEFAULTS, GPU_DEFAULTS

    dev = pick_device(args.device)
    args.device_resolved = str(dev)
    defaults = GPU_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS
    args.preset = args.preset or defaults["preset"]
    args.lr = args.lr or defaults["lr"]
    args.vocab_size = args.vocab_size or defaults["vocab_size"]
    os.makedirs(args.out, exist_ok=True)
    results = {a: run_arm(a, args) for a in args.arms}
    # arms run by earlier calls join the table too
    for a in ARMS:
        if a not in results and _records(os.path.join(args.out, a)):
            results[a] = _records(os.path.join(args.out, a))
    rows = [summarize(a, r, os.path.isfile(os.path.join(args.out, a, "diverged.txt"))) for a, r in results.items()]
    with open(os.path.join(args.out, "claims.json"), "w") as f:
        json.dump(dict(preset=args.preset, steps=args.steps, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                       lr=args.lr, clip_lr=args.clip_lr, device=args.device_resolved, arms=rows), f, indent=1)
    cols = ["arm", "steps", "diverged", "train_loss", "val_loss_best", "val_loss_final", "load_max_over_mean",
            "ideal_load_max_over_mean", "experts_without_tokens", "max_logit"]
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    with open(os.path.join(args.out, "claims.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    plot(results, args.out)


if __name__ == "__main__":
    main()
