"""`k3 rl`: reinforcement learning of a checkpoint on the agent environments (registered by k3.cli).

    k3 rl --ckpt runs/sft --tasks arith:200 --heldout arith:100 --harness terminal --out runs/rl \\
          --groups 8 --samples 4 --lam 0.75 --loss kimi --max-steps 50
"""

from __future__ import annotations

import os

from k3 import cli_args as cli

__all__ = ["add_parser"]


def _budget_tau(s: str) -> tuple[float, float]:
    import argparse

    try:
        parts = [float(x) for x in s.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not all(p > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected TAU or START:END (positive numbers, e.g. 4 or 4:1.5), got {s!r}")
    return (parts[0], parts[-1])


def _fraction(s: str) -> float:
    import argparse

    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}")
    return v


def add_parser(sub) -> None:
    s = sub.add_parser("rl", help="reinforcement learning on agent environments: partial rollouts, Kimi K2.5's "
                       "per-token objective, reasoning-effort budgets (report §4.1.2)")
    s.add_argument("--ckpt", help="the checkpoint to train (an SFT cold start; or a run directory: its latest)")
    s.add_argument("--tasks", nargs="+", metavar="FAMILY[:N]", help="training task families and how many of each "
                   "(the train split; default N 10), e.g. arith:200 code:64")
    s.add_argument("--heldout", nargs="+", metavar="FAMILY[:N]", help="held-out task families (the test split), "
                   "evaluated every --eval-every steps: val_success, and val_loss = 1 - success")
    s.add_argument("--harness", default="react", help="a harness preset or JSON file (k3 env list)")
    s.add_argument("--out", default="runs/rl", help="run directory (checkpoints, metrics.jsonl, trajectories.jsonl, "
                   "reward.png)")
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint "
                   "(trajectories in flight are started again)")
    s.add_argument("--groups", type=cli._positive_int, default=8, help="N: prompts (tasks) per iteration")
    s.add_argument("--samples", type=cli._positive_int, default=4, help="K: samples per prompt (>= 2)")
    s.add_argument("--lam", type=_fraction, default=1.0, help="lambda: rollouts pause once this fraction of the "
                   "N x K trajectories finished (partial rollouts; 1: wait for all)")
    s.add_argument("--loss", choices=["kimi", "ppo"], default="kimi",
                   help="kimi: Kimi K2.5's per-token objective (clipped ratio x advantage - tau (log ratio)^2); ppo: "
                        "the clipped importance-ratio baseline")
    s.add_argument("--tau", type=float, default=0.05, help="kimi: coefficient of the squared log-ratio (default 0.05)")
    s.add_argument("--clip-range", type=float, nargs=2, default=(0.5, 2.0), metavar=("ALPHA", "BETA"),
                   help="kimi: tokens whose ratio leaves [ALPHA, BETA] get no policy-gradient term (default 0.5 2)")
    s.add_argument("--ppo-eps", type=float, default=0.2, help="ppo: clip the ratio to [1-eps, 1+eps]")
    s.add_argument("--max-turn-tokens", type=cli._positive_int, default=256, help="tokens per assistant turn")
    s.add_argument("--max-context", type=cli._positive_int, default=4096, help="tokens per trajectory (prompt, "
                   "turns, tool results); the row length of training")
    s.add_argument("--effort", choices=["low", "medium", "high", "max"], help="the template's thinking-effort "
                   "option (thinking mode)")
    s.add_argument("--budget-tau", type=_budget_tau, metavar="TAU[:END]", help="reasoning-effort budget control: "
                   "reward -1 for trajectories over TAU x b0(x); START:END anneals it linearly over the run")
    s.add_argument("--budgets", help="b0(x) per task as JSON {task id: tokens} (default: measured before step 1 "
                   "from the starting model, written to OUT/budgets.json)")
    s.add_argument("--eval-samples", type=cli._positive_int, default=1, help="episodes per held-out task")
    s.add_argument("--eval-temperature", type=float, choices=[0.0, 1.0], default=0.0,
                   help="held-out sampling: 0 greedy (default) or 1")
    s.add_argument("--task-seed", type=int, default=0, help="the task instances' seed")
    s.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap",
                   help="bwrap: isolated (default); none: agent commands run UNISOLATED on this machine")
    s.add_argument("--concurrency", type=cli._positive_int, default=64,
                   help="requests in the engine at the start; the throttle adapts it to the cache (default 64)")
    s.add_argument("--fixed-concurrency", action="store_true", help="keep --concurrency (no auto-throttling)")
    s.add_argument("--no-write-back", dest="write_back", action="store_false",
                   help="re-prefill paused trajectories instead of keeping their prefixes in host memory")
    s.add_argument("--tool-workers", type=cli._positive_int, default=4, help="threads running tool calls")
    s.add_argument("--rollout-cache-mb", type=cli._positive_float, default=256.0,
                   help="the rollout engine's cache pool (MLA KV, KDA states, prefix checkpoints)")
    cli._add_trainer_flags(s)
    for action in s._actions:
        if action.dest == "balance":
            action.help = "expert load balancing (default none: the expert bias stays as the checkpoint has it)"
    s.set_defaults(fn=cmd_rl)


def cmd_rl(args) -> int:
    from k3.devices import pick_device
    from k3.posttrain.distill import student_qat
    from k3.rl.loss import RLLossConfig
    from k3.rl.trainer import CPU_DEFAULTS, GPU_DEFAULTS, RLOptions, run_rl

    if args.seq_len is not None or args.batch_tokens is not None:
        raise SystemExit("k3 rl: --seq-len and --batch-tokens do not apply: a row is one trajectory (up to "
                         "--max-context tokens) and a step holds --groups x --samples of them")
    if args.ckpt is None and not args.resume:
        raise SystemExit("k3 rl: --ckpt is required (the checkpoint to train), unless --resume")
    if not args.tasks:
        raise SystemExit("k3 rl: --tasks is required (FAMILY[:N] ..., e.g. arith:200)")
    device = pick_device(args.device)
    defaults = dict(GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS, seq_len=8, batch_tokens=8,
                    micro_batch_rows=None, eval_every=10)
    ckpt = None if args.ckpt is None else cli._resolve_ckpt(args.ckpt)
    if args.qat is None and not args.resume and ckpt is not None and os.path.isdir(ckpt):
        args.qat = student_qat(ckpt)  # a QAT-trained policy keeps its quantization, in training and rollouts
    tcfg = cli._train_config(args, defaults)
    if args.balance is None and not args.resume:
        # The expert bias stays as the checkpoint has it: Quantile Balancing re-fits it from each step's batch, and
        # on an RL batch (a few thousand sampled tokens) that re-fit moves the policy away from the one that
        # sampled the trajectories whatever the reward says (measured on the arith cold start: one step at a
        # learning rate of ~0 changed whole trajectories' log-probabilities by up to 1.5 nats).
        tcfg.balance = "none"
    opts = RLOptions(ckpt=ckpt, tasks=args.tasks, heldout=args.heldout or [], harness=args.harness,
                     resume=args.resume, groups=args.groups, samples=args.samples, lam=args.lam,
                     loss=RLLossConfig(kind=args.loss, tau=args.tau, alpha=args.clip_range[0],
                                       beta=args.clip_range[1], eps=args.ppo_eps),
                     max_turn_tokens=args.max_turn_tokens, max_context=args.max_context, effort=args.effort,
                     budget_tau=args.budget_tau, budgets=args.budgets, eval_samples=args.eval_samples,
                     eval_temperature=args.eval_temperature, sandbox=args.sandbox, task_seed=args.task_seed,
                     cache_memory_mb=args.rollout_cache_mb, concurrency=args.concurrency,
                     fixed_concurrency=args.fixed_concurrency, write_back=args.write_back,
                     tool_workers=args.tool_workers, device=str(device), backends=cli._backends(args.backend, device),
                     verify=args.verify)
    try:
        return cli.run_training_command("rl", lambda: run_rl(opts, tcfg, progress_bar=not args.no_progress))
    except ValueError as e:
        raise SystemExit(f"k3 rl: {e}") from None
