"""The CPU demonstration of `k3 rl` (BENCHMARKS.md, "Reinforcement learning"): an SFT cold start on scripted
tool-use trajectories, then RL on the `arith` family, against SFT alone at equal training tokens, over seeds; and
two ablations: partial rollouts (lambda < 1) against lambda = 1 at equal wall time, and Kimi's per-token objective
against the clipped PPO baseline under high staleness.

    python benchmarks/rl_demo.py --out runs/rl_demo                 # everything (a few hours on 2 cores)
    python benchmarks/rl_demo.py --out runs/rl_demo --stages base sft mix rl

The defaults are the measured recipe of BENCHMARKS.md's third attempt (its cold start was built in two SFT stages,
300 steps on 1,500 demonstrations then 400 on 6,000; `--sft-demos 6000 --sft-steps 700` is the one-stage form).

Stages (each skips what its output directory already holds, so a stopped run continues):
  base     `k3 env demos` conversations (train split, seed 1; held-out from the test split), a byte-level BPE
           trained on their renderings, a small random hybrid model (4 layers: 2 KDA, 2 Gated MLA)
  sft      `k3 sft` for --sft-steps steps on the demonstrations
  mix      the cold start: `k3 sft` from the sft stage for --mix-steps steps on demonstrations of a teacher that
           answers a fraction --direct-fraction of the problems without the tool (it knows the answer; the small
           student does not, so imitating those answers fails): imitation cannot tell which demonstrations its
           student can follow, the reward can
  rl       per seed: `k3 rl` from the cold start for --rl-steps steps (N x K, lambda 1, kimi), and the control: `k3
           sft` continued from the cold start for the same number of trained tokens; both evaluated on the same
           held-out tasks (greedy, one episode each)
  lam      per seed: lambda 0.5 against 1 (--lams), each for --ablation-minutes of rollout and training time
  stale    per seed: kimi against ppo (--losses) at lambda 0.25 (many paused, stale trajectories), --rl-steps steps
  plot     rl_lambda.png and rl_stale.png from the lam and stale stages' runs
  control  per seed: SFT alone at the cold start's own learning rate (--control-lr, default --mix-lr) for the rl
           stage's equal-token step count (or --control-steps)
The results go to OUT/results.json and OUT/results.md, the plots to OUT/rl_demo.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HARNESS = {"name": "compact",
           "tools": [{"tool": "python", "description": "Run Python code; returns its output."},
                     {"tool": "submit", "description": "Submit the final answer."}],
           "system_prompt": "Solve the task with the tools. Finish with {submit}."}


def sh(argv: list[str]) -> None:
    from k3.cli import main

    print("$ k3 " + " ".join(argv), flush=True)
    rc = main(argv)
    if rc not in (0, None):
        raise SystemExit(f"k3 {argv[0]} failed with status {rc}")


def stage_base(a) -> None:
    import torch

    from k3.checkpoint import save_pretrained
    from k3.config import K3Config
    from k3.data.tokenizer import train_bpe
    from k3.env.demos import make_demos, plan_demo_jobs, write_demos
    from k3.model.model import K3ForCausalLM
    from k3.serve.chat import render_chat, save_chat_template

    base = os.path.join(a.out, "base")
    if os.path.isfile(os.path.join(base, "config.json")):
        return
    harness = os.path.join(a.out, "harness.json")
    with open(harness, "w") as f:
        json.dump(HARNESS, f, indent=1)
    for split, n, path in (("train", a.sft_demos, "sft.jsonl"), ("test", 100, "sft_heldout.jsonl")):
        rep = make_demos(plan_demo_jobs([("arith", n)], [harness], split=split, seed=1), concurrency=4,
                         sandbox_kind=a.sandbox, stand_ins=True, progress=False)
        write_demos(os.path.join(a.out, path), rep.records)
        print(f"demos: {len(rep.records)} {split} conversations -> {path}")
    texts = []
    with open(os.path.join(a.out, "sft.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            texts.append(render_chat(r["messages"], None, False, tools=r["tools"]))
    tok = train_bpe(texts, a.vocab)
    cfg = K3Config.from_preset("tiny").replace(
        vocab_size=a.vocab, num_hidden_layers=4, kda_layers=[1, 2], full_attn_layers=[3, 4],
        num_nextn_predict_layers=0, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id, bos_token_id=None,
        max_position_embeddings=4096)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).init_weights(seed=0)
    save_pretrained(model, base, extra_files={"tokenizer.json": tok.to_str().encode("utf-8")})
    save_chat_template(base)
    lens = [len(tok.encode(t)) for t in texts[:200]]
    print(f"base: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {a.vocab}; "
          f"a conversation is {min(lens)}-{max(lens)} tokens")


def mixed_demos(src: str, dst: str, fraction: float, seed: int = 0) -> tuple[int, int]:
    """Copy the demonstrations of `src` to `dst`, a seeded `fraction` of them rewritten so that the assistant submits
    the final answer at once, without the tool call that computed it. Returns (conversations, rewritten)."""
    import random

    from k3.files import atomic_write_text

    rng, lines, direct = random.Random(seed), [], 0
    with open(src, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            msgs = r["messages"]
            submit = [c for m in msgs if m["role"] == "assistant" for c in (m.get("tool_calls") or [])
                      if c["function"]["name"] == "submit"]
            if submit and rng.random() < fraction:
                first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
                call = {**submit[0], "id": "call_1_0"}
                r["messages"] = msgs[:first] + [
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1_0", "name": "submit", "content": "answer submitted"}]
                direct += 1
            lines.append(json.dumps(r))
    atomic_write_text(dst, "\n".join(lines) + "\n")
    return len(lines), direct


def stage_mix(a) -> None:
    out = os.path.join(a.out, "sft_mixed")
    if os.path.isdir(os.path.join(out, "checkpoints")):
        return
    n, direct = mixed_demos(os.path.join(a.out, "sft.jsonl"), os.path.join(a.out, "sft_mixed.jsonl"),
                            a.direct_fraction)
    print(f"mixed demonstrations: {direct} of {n} answer without the tool -> sft_mixed.jsonl")
    sh(["sft", "--ckpt", a.sft_ckpt or latest(os.path.join(a.out, "sft")), "--data", os.path.join(a.out, "sft_mixed.jsonl"),
        "--out", out, "--seq-len", str(a.seq_len), "--batch-tokens", str(16 * a.seq_len), "--max-steps",
        str(a.mix_steps), "--lr", str(a.mix_lr), "--eval-every", "100000", "--seed", "0", "--no-progress"])


def stage_sft(a) -> None:
    out = os.path.join(a.out, "sft")
    if os.path.isdir(os.path.join(out, "checkpoints")):
        return
    sh(["sft", "--ckpt", os.path.join(a.out, "base"), "--data", os.path.join(a.out, "sft.jsonl"),
        "--heldout", os.path.join(a.out, "sft_heldout.jsonl"), "--out", out, "--seq-len", str(a.seq_len),
        "--batch-tokens", str(16 * a.seq_len), "--max-steps", str(a.sft_steps), "--lr", str(a.sft_lr),
        "--eval-every", "100", "--seed", "0", "--no-progress"])


def evaluate(a, ck: str, seed: int = 0) -> dict:
    """Held-out success of checkpoint `ck`: each of the --heldout test tasks once, at --eval-temperature."""
    import torch

    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.env.episode import Episode
    from k3.env.presets import load_harness
    from k3.env.run import task_instances
    from k3.rl.rollout import AgentRollouts, RolloutConfig, Throttle
    from k3.rl.trainer import evaluate_policy
    from k3.serve.chat import load_chat_template
    from k3.serve.engine import EngineConfig

    model = from_pretrained(ck, dtype=torch.float32)
    tok, template = load_any_tokenizer(ck), load_chat_template(ck)
    harness = load_harness(os.path.join(a.out, "harness.json"))
    ro = AgentRollouts(model, tok, template, RolloutConfig(harness=harness, sandbox_kind=a.sandbox,
                                                           max_turn_tokens=a.turn_tokens,
                                                           temperature=a.eval_temperature,
                                                           write_back=False),
                       EngineConfig(cache_memory_mb=128.0, page_tokens=256, hash_block_tokens=64, cuda_graphs=False,
                                    max_model_len=a.seq_len), Throttle(start=64, fixed=True))
    tasks = task_instances([f"arith:{a.heldout}"], "test", 0)
    try:
        return evaluate_policy(ro, tasks, lambda t: Episode(t, harness, None, sandbox_kind=a.sandbox), 1, seed)
    finally:
        ro.close()


def latest(run: str) -> str:
    from k3.run_dir import latest_checkpoint

    ck = latest_checkpoint(run)
    if ck is None:
        raise SystemExit(f"{run} has no checkpoint")
    return ck


def rl_args(a, out: str, seed: int, **kw) -> list[str]:
    args = ["rl", "--ckpt", cold_start(a), "--tasks", f"arith:{a.rl_tasks}",
            "--heldout", f"arith:{a.heldout}", "--harness", os.path.join(a.out, "harness.json"), "--out", out,
            "--groups", str(a.groups), "--samples", str(a.samples), "--max-turn-tokens", str(a.turn_tokens),
            "--max-context", str(a.seq_len), "--lr", str(a.rl_lr), "--seed", str(seed), "--sandbox", a.sandbox,
            "--rollout-cache-mb", "128", "--eval-temperature", str(a.eval_temperature), "--no-progress",
            "--optimizer", a.rl_optimizer]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def trained_tokens(run: str) -> int:
    """Response tokens the RL run trained on (sampled tokens of its optimized trajectories)."""
    n = 0
    with open(os.path.join(run, "trajectories.jsonl")) as f:
        for line in f:
            n += json.loads(line)["output_tokens"]
    return n


def cold_start(a) -> str:
    """--cold-start, else the mix stage's checkpoint when it ran, else the sft stage's."""
    if a.cold_start:
        return a.cold_start
    mixed = os.path.join(a.out, "sft_mixed")
    return latest(mixed if os.path.isdir(os.path.join(mixed, "checkpoints")) else os.path.join(a.out, "sft"))


def control_data(a) -> str:
    """The SFT control's data: --sft-data, else the cold start's own last demonstrations."""
    if a.sft_data:
        return a.sft_data
    mixed = os.path.join(a.out, "sft_mixed.jsonl")
    return mixed if os.path.isfile(mixed) and not a.cold_start else os.path.join(a.out, "sft.jsonl")


def stage_rl(a, results: dict) -> None:
    from k3.rl.report import read_metrics

    cold = cold_start(a)
    if "cold_start" not in results:
        results["cold_start"] = evaluate(a, cold)
        print(f"cold start: held-out success {100 * results['cold_start']['success']:.1f}%")
    for seed in a.seeds:
        key = f"seed{seed}"
        rec = results.setdefault("rl", {}).setdefault(key, {})
        run = os.path.join(a.out, f"rl_seed{seed}")
        if "rl" not in rec:
            if not os.path.isdir(os.path.join(run, "checkpoints")):
                budget = {"max_minutes": a.rl_minutes} if a.rl_minutes else {"max_steps": a.rl_steps}
                sh(rl_args(a, run, seed, **budget, eval_every=100_000, lam=1.0, loss="kimi"))
            vals = [r for r in read_metrics(os.path.join(run, "metrics.jsonl")) if "val_success" in r]
            rec["rl"] = {"before": vals[0]["val_success"], "after": vals[-1]["val_success"],
                         "trained_response_tokens": trained_tokens(run),
                         "wall_s": sum(r.get("rollout_s", 0) + r.get("train_s", 0)
                                       for r in read_metrics(os.path.join(run, "metrics.jsonl")))}
            save(a, results)
        if "sft" not in rec:
            ctl = os.path.join(a.out, f"sft_more_seed{seed}")
            # equal tokens: the control SFT trains on as many reply tokens as the RL run trained response tokens
            if not os.path.isdir(os.path.join(ctl, "checkpoints")):
                per_step = reply_tokens_per_step(a)
                steps = max(1, round(rec["rl"]["trained_response_tokens"] / per_step))
                sh(["sft", "--ckpt", cold, "--data", control_data(a), "--out", ctl,
                    "--seq-len", str(a.seq_len), "--batch-tokens", str(16 * a.seq_len), "--max-steps", str(steps),
                    "--lr", str(a.rl_lr), "--seed", str(seed), "--eval-every", "1000", "--no-progress"])
                rec["sft_steps"] = steps
            rec["sft"] = {"after": evaluate(a, latest(ctl))["success"]}
            save(a, results)


def reply_tokens_per_step(a) -> float:
    """Trained (reply) tokens per SFT step: 16 conversations' replies."""
    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.chat import encode_segments, render_chat_segments

    tok = load_any_tokenizer(os.path.join(a.out, "base"))
    n, k = 0, 0
    with open(control_data(a)) as f:
        for line in f:
            r = json.loads(line)
            segs = render_chat_segments(r["messages"], None, False, tools=r["tools"])
            n += len(encode_segments(tok, [s for s in segs if s.train]))
            k += 1
            if k == 200:
                break
    return 16 * n / k


def run_summary(run: str) -> dict:
    """Held-out success before and after, and the per-step averages of an RL run's metrics.jsonl."""
    from k3.rl.report import read_metrics

    recs = read_metrics(os.path.join(run, "metrics.jsonl"))
    steps = [r for r in recs if "reward" in r]
    vals = [r for r in recs if "val_success" in r]
    n = max(len(steps), 1)
    return {"before": vals[0]["val_success"], "after": vals[-1]["val_success"], "steps": len(steps),
            "rollout_s": sum(r["rollout_s"] for r in steps), "train_s": sum(r["train_s"] for r in steps),
            "staleness": sum(r["staleness"] for r in steps) / n,
            "max_staleness": max((r["max_staleness"] for r in steps), default=0),
            "masked_frac": sum(r["masked_frac"] for r in steps) / n,
            "paused": sum(r["paused"] for r in steps) / n,
            "trained_response_tokens": trained_tokens(run),
            "reward_last5": sum(r["reward"] for r in steps[-5:]) / max(len(steps[-5:]), 1)}


def stage_lam(a, results: dict) -> None:
    """Per seed and lambda: RL for --ablation-minutes of rollout and training time (equal wall time)."""
    for seed in a.seeds:
        for lam in a.lams:
            key, sub = f"lam{lam:g}", f"seed{seed}"
            if sub in results.setdefault("lam", {}).setdefault(key, {}):
                continue
            run = os.path.join(a.out, f"rl_lam{lam:g}_seed{seed}")
            if not os.path.isdir(os.path.join(run, "checkpoints")):
                sh(rl_args(a, run, seed, max_minutes=a.ablation_minutes, eval_every=100_000, lam=lam, loss="kimi"))
            results["lam"][key][sub] = run_summary(run)
            save(a, results)


def stage_stale(a, results: dict) -> None:
    """Per seed and loss: RL at lambda 0.25 (many paused, stale trajectories) for --rl-steps steps."""
    for seed in a.seeds:
        for loss in a.losses:
            sub = f"seed{seed}"
            if sub in results.setdefault("stale", {}).setdefault(loss, {}):
                continue
            run = os.path.join(a.out, f"rl_stale_{loss}_seed{seed}")
            if not os.path.isdir(os.path.join(run, "checkpoints")):
                sh(rl_args(a, run, seed, max_steps=a.rl_steps, eval_every=100_000, lam=0.25, loss=loss))
            results["stale"][loss][sub] = run_summary(run)
            save(a, results)


def stage_control(a, results: dict) -> None:
    """Per seed: SFT alone at --control-lr (default the cold start's --mix-lr) for --control-steps steps (default
    the equal-token count of the rl stage's seed), evaluated like the rl stage's control."""
    lr = a.control_lr if a.control_lr is not None else a.mix_lr
    for seed in a.seeds:
        key, sub = f"lr{lr:g}", f"seed{seed}"
        if sub in results.setdefault("control", {}).setdefault(key, {}):
            continue
        steps = a.control_steps or results.get("rl", {}).get(sub, {}).get("sft_steps")
        if not steps:
            raise SystemExit(f"control: no --control-steps and no rl stage result for {sub} to match")
        ctl = os.path.join(a.out, f"sft_lr{lr:g}_seed{seed}")
        if not os.path.isdir(os.path.join(ctl, "checkpoints")):
            sh(["sft", "--ckpt", cold_start(a), "--data", control_data(a), "--out", ctl,
                "--seq-len", str(a.seq_len), "--batch-tokens", str(16 * a.seq_len), "--max-steps", str(steps),
                "--lr", str(lr), "--seed", str(seed), "--eval-every", "1000", "--no-progress"])
        results["control"][key][sub] = {"steps": steps, "after": evaluate(a, latest(ctl))["success"]}
        save(a, results)


def stage_plot(a, results: dict) -> None:
    """OUT/rl_lambda.png: rollout success of the lam stage's runs over their rollout + training seconds (lambda 1
    and 0.5 per seed); OUT/rl_stale.png: rollout reward of the stale stage's runs over steps (kimi and ppo per seed)."""
    import glob

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k3.files import atomic_write_bytes
    from k3.rl.report import read_metrics

    def save_fig(fig, name):
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        atomic_write_bytes(os.path.join(a.out, name), buf.getvalue())
        print(f"wrote {os.path.join(a.out, name)}")

    for stage, pattern, name in (("lam", "rl_lam*_seed*", "rl_lambda.png"), ("stale", "rl_stale_*_seed*", "rl_stale.png")):
        runs = sorted(glob.glob(os.path.join(a.out, pattern)))
        if not runs:
            continue
        seeds = sorted({r.rsplit("_seed", 1)[1] for r in runs})
        fig, axes = plt.subplots(1, len(seeds), figsize=(4.2 * len(seeds), 3.2), squeeze=False, sharey=True)
        for ax, seed in zip(axes[0], seeds):
            for run in sorted(r for r in runs if r.endswith(f"_seed{seed}")):
                recs = [r for r in read_metrics(os.path.join(run, "metrics.jsonl")) if "reward" in r]
                label = os.path.basename(run).split("_seed")[0].replace("rl_", "")
                if stage == "lam":
                    t, xs = 0.0, []
                    for r in recs:
                        t += r["rollout_s"] + r["train_s"]
                        xs.append(t)
                    ax.plot(xs, [r["success"] for r in recs], marker="o", ms=3, lw=1, label=label)
                    ax.set_xlabel("rollout + training seconds")
                else:
                    ax.plot([r["step"] for r in recs], [r["reward"] for r in recs], marker="o", ms=3, lw=1,
                            label=label)
                    ax.set_xlabel("step")
            ax.set_title(f"seed {seed}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("rollout success" if stage == "lam" else "rollout reward")
        save_fig(fig, name)


def save(a, results: dict) -> None:
    from k3.files import atomic_write_text

    atomic_write_text(os.path.join(a.out, a.results), json.dumps(results, indent=1) + "\n")


def main(argv=None) -> int:
    from k3.cli_args import RawDefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/rl_demo")
    p.add_argument("--stages", nargs="+", default=["base", "sft", "mix", "rl", "lam", "stale"],
                   choices=["base", "sft", "mix", "rl", "lam", "stale", "control", "plot"])
    p.add_argument("--results", default="results.json",
                   help="the results file in --out (separate names let several processes share one --out)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sft-demos", type=int, default=6000)
    p.add_argument("--sft-steps", type=int, default=700)
    p.add_argument("--cold-start", help="an SFT checkpoint to start RL from instead of the sft stage's")
    p.add_argument("--sft-data", help="the control's SFT data (default OUT/sft.jsonl)")
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--direct-fraction", type=float, default=0.3,
                   help="mix: the fraction of demonstrations that answer without the tool (default 0.3)")
    p.add_argument("--sft-ckpt", help="mix: start from this checkpoint instead of the sft stage's latest")
    p.add_argument("--mix-steps", type=int, default=40, help="mix: SFT steps on the mixed demonstrations (default 40)")
    p.add_argument("--mix-lr", type=float, default=3e-4, help="mix: their learning rate (default 3e-4)")
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-minutes", type=float, help="rl: train each seed for this many minutes instead of --rl-steps")
    p.add_argument("--rl-lr", type=float, default=5e-5)
    p.add_argument("--rl-optimizer", choices=["adamw", "muon", "per-head-muon"], default="adamw")
    p.add_argument("--rl-tasks", type=int, default=400)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--eval-temperature", type=float, default=1.0, choices=[0.0, 1.0],
                   help="held-out episodes sampled as the policy samples (1, default) or greedy (0)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--ablation-minutes", type=float, default=6.0)
    p.add_argument("--lams", type=float, nargs="+", default=[1.0, 0.5], help="lam: the lambdas (default 1 0.5)")
    p.add_argument("--losses", nargs="+", choices=["kimi", "ppo"], default=["kimi", "ppo"],
                   help="stale: the objectives (default kimi ppo)")
    p.add_argument("--control-lr", type=float, help="control: SFT learning rate (default --mix-lr)")
    p.add_argument("--control-steps", type=int, help="control: SFT steps (default: the rl stage's equal-token count)")
    p.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, a.results)
    results = json.load(open(path)) if os.path.isfile(path) else {}
    t0 = time.time()
    for st in a.stages:
        {"base": lambda: stage_base(a), "sft": lambda: stage_sft(a), "mix": lambda: stage_mix(a),
         "rl": lambda: stage_rl(a, results),
         "lam": lambda: stage_lam(a, results), "stale": lambda: stage_stale(a, results),
         "control": lambda: stage_control(a, results), "plot": lambda: stage_plot(a, results)}[st]()
        print(f"[{time.time() - t0:.0f}s] stage {st} done", flush=True)
    save(a, results)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
