"""The architecture's claims at equal tokens (BENCHMARKS.md, "Architecture study"): each ablation arm of K3's
architecture trained from scratch on the same data for the same number of tokens, over seeds, then compared.

    python benchmarks/arch_study.py --out runs/arch                       # CPU: the tiny preset, minutes per arm
    python benchmarks/arch_study.py --out runs/arch --preset k3-mini --device cuda --steps 300 \\
        --seq-len 4096 --batch-tokens 131072 --eval-lengths 4096 8192 16384 32768

Arms (k3.config ablation fields; `K3Config.ablations()` names what each changes):
  k3         K3's own architecture: 3 KDA : 1 Gated MLA (MLA every 4th and the last layer), NoPE, gated MLA,
             Block AttnRes, latent MoE
  hybrid11   1 KDA : 1 Gated MLA (MLA every 2nd and the last layer)
  all_mla    every layer Gated MLA (full attention)
  all_kda    every layer KDA
  rope       RoPE on the MLA rope slice (--rope-theta) instead of NoPE
  ungated    MLA without its output gate
  plain_res  plain residuals instead of Block AttnRes

Stages (each skips what its output already holds, so a stopped study continues):
  train    per arm and seed: `k3 train` from scratch, --steps steps of --batch-tokens tokens at --seq-len
  eval     per run: held-out loss at the training length, and `k3 eval --long` (passkey retrieval over lengths and
           depths, and the per-position loss out to --eval-lengths' largest: the extrapolation curve)
  lr       gated against ungated MLA at a high learning rate (--high-lr) with QK-Clip's threshold out of reach
           (logits tracked, never clipped): the largest attention logit and the loss spikes per step
  report   OUT/results.json, OUT/results.md (tables: mean +- standard deviation over seeds) and the plots
           arch_loss.png, arch_extrapolation.png, arch_max_logit.png

Seed noise: every comparison is stated with the seeds' spread; a difference within it is reported as none.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys

# arm -> (layer pattern rule or None for K3's, config changes)
ARMS = {
    "k3": (None, {}),
    "hybrid11": ("1:1", {}),
    "all_mla": ("M", {}),
    "all_kda": ("K", {}),
    "rope": (None, {"mla_use_nope": False}),
    "ungated": (None, {"mla_use_output_gate": False}),
    "plain_res": (None, {"residual": "plain"}),
}


def pattern(rule: str | None, layers: int) -> str | None:
    """The layer pattern (K/M per layer) of a rule: None keeps the preset's (K3's), 'M' all-MLA, 'K' all-KDA, '1:1'
    MLA every 2nd layer and the last."""
    if rule is None:
        return None
    if rule in ("M", "K"):
        return rule * layers
    if rule == "1:1":
        return "".join("M" if (i % 2 == 1 or i == layers - 1) else "K" for i in range(layers))
    raise ValueError(f"unknown layer rule {rule!r}")


def arm_config(a, arm: str) -> dict:
    """The config.json (official layout) of an arm: the preset with the arm's changes."""
    from k3.config import K3Config, layer_lists

    rule, changes = ARMS[arm]
    cfg = K3Config.from_preset(a.preset)
    changes = dict(changes)
    if changes.get("mla_use_nope") is False:
        changes["rope_theta"] = a.rope_theta
    p = pattern(rule, cfg.num_hidden_layers)
    if p is not None:
        kda, full = layer_lists(p)
        changes.update(kda_layers=kda, full_attn_layers=full)
    cfg = cfg.replace(**changes)
    cfg.validate()
    return cfg.to_dict()


def sh(argv: list[str]) -> None:
    from k3.cli import main

    print("$ k3 " + " ".join(argv), flush=True)
    rc = main(argv)
    if rc not in (0, None):
        raise SystemExit(f"k3 {argv[0]} failed with status {rc}")


def write_json(path: str, obj) -> None:
    from k3.files import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def run_dir(a, arm: str, seed: int, tag: str = "") -> str:
    return os.path.join(a.out, "runs", f"{arm}{tag}_s{seed}")


def latest(run: str) -> str:
    ck = os.path.join(run, "checkpoints")
    steps = sorted(d for d in os.listdir(ck) if d.startswith("step-")) if os.path.isdir(ck) else []
    if not steps:
        raise SystemExit(f"{run}: no checkpoint (run the train stage)")
    return os.path.join(ck, steps[-1])


def train(a, arm: str, seed: int, lr: float | None = None, tag: str = "", extra: list[str] = ()) -> str:
    run = run_dir(a, arm, seed, tag)
    if os.path.isdir(os.path.join(run, "checkpoints")) and any(
            d.startswith("step-") and int(d[5:]) >= a.steps for d in os.listdir(os.path.join(run, "checkpoints"))):
        return run
    ck = os.path.join(run, "checkpoints")
    if os.path.isdir(run) and not (os.path.isdir(ck) and any(d.startswith("step-") for d in os.listdir(ck))):
        shutil.rmtree(run)  # stopped before its first checkpoint: start it again
    os.makedirs(run, exist_ok=True)
    cfg_path = os.path.join(a.out, "configs", f"{arm}.json")
    os.makedirs(os.path.dirname(cfg_path), exist_ok=True)
    write_json(cfg_path, arm_config(a, arm))
    argv = ["train", "--config", cfg_path, "--out", run, "--max-steps", str(a.steps), "--seq-len", str(a.seq_len),
            "--batch-tokens", str(a.batch_tokens), "--seed", str(seed), "--eval-every", str(a.steps),
            "--device", a.device, "--no-progress", "--save-every-minutes", "1000", "--keep-checkpoints", "1"]
    if os.path.isdir(os.path.join(run, "checkpoints")):
        argv.append("--resume")
    if a.data:
        argv += sum((["--data", d] for d in a.data), [])
    if a.max_corpus_mb:
        argv += ["--max-corpus-mb", str(a.max_corpus_mb)]
    if lr is not None:
        argv += ["--lr", str(lr)]
    sh(argv + list(extra))
    return run


def metrics(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stage_train(a) -> None:
    for seed in a.seeds:
        for arm in a.arms:
            train(a, arm, seed)


def stage_eval(a, results: dict) -> None:
    for seed in a.seeds:
        for arm in a.arms:
            key = f"{arm}_s{seed}"
            r = results.setdefault("runs", {}).setdefault(key, {"arm": arm, "seed": seed})
            run = run_dir(a, arm, seed)
            ck = latest(run)
            vals = [m["val_loss"] for m in metrics(run) if "val_loss" in m]
            r["val_loss"] = vals[-1]
            r["train_loss"] = [m["loss"] for m in metrics(run) if "loss" in m][-1]
            out = os.path.join(run, "long_eval")
            if not os.path.exists(os.path.join(out, "long_eval.json")):
                sh(["eval", "--ckpt", ck, "--long", "--out", out, "--device", a.device,
                    "--lengths", ",".join(map(str, a.eval_lengths)), "--items", str(a.passkey_items),
                    "--depths", ",".join(map(str, a.depths)),
                    "--train-length", str(a.seq_len)] + sum((["--data", d] for d in a.eval_data or []), []))
            with open(os.path.join(out, "long_eval.json"), encoding="utf-8") as f:
                r["long"] = long_summary(json.load(f), a.seq_len)
            save(a, results)


def long_summary(d: dict, train_len: int) -> dict:
    """From `k3 eval --long`'s long_eval.json: passkey accuracy per length (mean over depths), and the
    extrapolation curve (loss per position bucket) with its mean within and beyond the training length."""
    acc = {}
    for cell in d["passkey"]["cells"]:
        acc.setdefault(cell["length"], []).append(cell["accuracy"])
    ex = d["extrapolation"]
    return {"passkey": {str(k): statistics.fmean(v) for k, v in sorted(acc.items())},
            "chance": d["passkey"]["chance"],
            "curve": [[b["start"], b["end"], b["loss"]] for b in ex["buckets"] if b.get("tokens")],
            "loss_inside": ex.get("loss_within_train_length"), "loss_beyond": ex.get("loss_beyond_train_length")}


def stage_lr(a, results: dict) -> None:
    """Gated vs ungated MLA at --high-lr, QK-Clip tracking but never clipping (its threshold out of reach)."""
    for seed in a.seeds:
        for arm in ("k3", "ungated"):
            run = train(a, arm, seed, lr=a.high_lr, tag="_hilr", extra=["--qk-clip-tau", "1e30"])
            ms = [m for m in metrics(run) if "loss" in m]
            losses = [m["loss"] for m in ms]
            spikes = sum(1 for i in range(1, len(losses)) if losses[i] > a.spike * min(losses[:i]))
            results.setdefault("lr", {})[f"{arm}_s{seed}"] = {
                "arm": arm, "seed": seed, "lr": a.high_lr, "max_logit": [m.get("max_logit") for m in ms],
                "loss": losses, "spikes": spikes, "final_loss": losses[-1],
                "diverged": any(not math.isfinite(x) for x in losses)}
            save(a, results)


def mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} +- {statistics.stdev(xs):.3f}"


def stage_report(a, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results.get("runs", {})
    arms = [arm for arm in a.arms if any(r["arm"] == arm for r in runs.values())]
    lines = [f"Preset {a.preset}, {a.steps} steps x {a.batch_tokens:,} tokens at {a.seq_len} (equal tokens per arm), "
             f"seeds {', '.join(map(str, a.seeds))}; mean +- standard deviation over seeds.", ""]
    lengths = sorted({int(k) for r in runs.values() for k in r.get("long", {}).get("passkey", {})})
    head = ["arm", "held-out loss", f"loss <= {a.seq_len}", f"loss > {a.seq_len}"] + [f"passkey {n}" for n in lengths]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        rs = [r for r in runs.values() if r["arm"] == arm]
        row = [arm, mean_sd([r.get("val_loss") for r in rs]),
               mean_sd([r.get("long", {}).get("loss_inside") for r in rs]),
               mean_sd([r.get("long", {}).get("loss_beyond") for r in rs])]
        row += [mean_sd([r.get("long", {}).get("passkey", {}).get(str(n)) for r in rs]) for n in lengths]
        lines.append("| " + " | ".join(row) + " |")
    chance = next((r["long"]["chance"] for r in runs.values() if "long" in r), None)
    if chance is not None:
        lines += ["", f"Passkey chance: {chance:.3f} (multiple choice among the true key and its distractors)."]
    lr = results.get("lr", {})
    if lr:
        lines += ["", f"Gated vs ungated MLA at lr {a.high_lr:g} (QK-Clip not clipping):", "",
                  "| arm | largest attention logit | loss spikes (> {:.2f} x the best so far) | final loss |".format(
                      a.spike), "|---|---|---|---|"]
        for arm in ("k3", "ungated"):
            rs = [r for r in lr.values() if r["arm"] == arm]
            if rs:
                lines.append(f"| {arm} | {mean_sd([max(x for x in r['max_logit'] if x is not None) for r in rs])} | "
                             f"{mean_sd([r['spikes'] for r in rs])} | {mean_sd([r['final_loss'] for r in rs])} |")
    from k3.files import atomic_write_text

    atomic_write_text(os.path.join(a.out, "results.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))

    def save_fig(fig, name):
        path = os.path.join(a.out, name)
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(arms):
        ys = [r["val_loss"] for r in runs.values() if r["arm"] == arm and "val_loss" in r]
        ax.scatter([i] * len(ys), ys, color=f"C{i}")
        if ys:
            ax.hlines(statistics.fmean(ys), i - 0.3, i + 0.3, color=f"C{i}")
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"{a.preset}: arms at equal tokens (dots: seeds)")
    save_fig(fig, "arch_loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(arms):
        for j, r in enumerate(r for r in runs.values() if r["arm"] == arm and "long" in r):
            xs = [(s + e) / 2 for s, e, _ in r["long"]["curve"]]
            ax.plot(xs, [l for _, _, l in r["long"]["curve"]], color=f"C{i}", label=arm if j == 0 else None)
    ax.axvline(a.seq_len, color="k", ls=":", label="training length")
    ax.set_xscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    ax.set_title("per-position loss beyond the training length")
    save_fig(fig, "arch_extrapolation.png")

    if lr:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, arm in enumerate(("k3", "ungated")):
            for j, r in enumerate(r for r in lr.values() if r["arm"] == arm):
                ax.plot(range(1, len(r["max_logit"]) + 1), r["max_logit"], color=f"C{i}",
                        label=("gated (K3)" if arm == "k3" else "ungated") if j == 0 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("largest attention logit")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"lr {a.high_lr:g}")
        save_fig(fig, "arch_max_logit.png")


def save(a, results: dict) -> None:
    write_json(os.path.join(a.out, "results.json"), results)


def main(argv=None) -> int:
    from k3.cli_args import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="study directory (runs, results, plots)")
    p.add_argument("--stages", nargs="+", default=["train", "eval", "lr", "report"],
                   choices=["train", "eval", "lr", "report"])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--preset", default="tiny", choices=["tiny", "k3-mini"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--data", action="append", help="training text (default: the standard library)")
    p.add_argument("--max-corpus-mb", type=float, default=4.0, help="cap on the standard-library corpus in MB; 0 for none")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (equal tokens per arm)")
    p.add_argument("--seq-len", type=int, default=256, help="training length")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0, help="the rope arm's RoPE base")
    p.add_argument("--eval-lengths", nargs="+", type=int, default=[256, 1024, 2048],
                   help="passkey lengths; the largest is also the extrapolation curve's")
    p.add_argument("--eval-data", action="append",
                   help="long held-out documents for the extrapolation curve and passkey filler (default: k3 eval "
                        "--long's)")
    p.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.5, 1.0], help="passkey needle depths")
    p.add_argument("--passkey-items", type=int, default=6, help="passkey items per (length, depth) cell")
    p.add_argument("--high-lr", type=float, default=0.03, help="the lr stage's learning rate")
    p.add_argument("--spike", type=float, default=1.2, help="a loss spike: a step's loss over this x the best so far")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "results.json")
    results = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    results["settings"] = {k: v for k, v in vars(a).items() if k != "stages"}
    for stage in a.stages:
        if stage == "train":
            stage_train(a)
        elif stage == "eval":
            stage_eval(a, results)
        elif stage == "lr":
            stage_lr(a, results)
        else:
            stage_report(a, results)
        save(a, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
