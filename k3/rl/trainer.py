"""`k3 rl`: reinforcement learning on the agent environments (report §4.1.2), through the Trainer's loss seam.

One iteration (one optimizer step):
  1. The active workload is topped up to N groups (prompts, i.e. tasks of the training split, in a shuffled order
     epoch after epoch), each of K samples: N x K trajectories, each an episode of the task under the harness, in
     its own sandbox (k3.rl.rollout.AgentRollouts).
  2. Rollouts advance on the serving engine over the module being trained. With lambda < 1 (partial rollouts),
     generation pauses as soon as lambda N K trajectories of the workload have finished and at least one group is
     complete; unfinished trajectories stay in the workload, their tokens, behaviour log-probs, policy versions and
     sandboxes kept, and resume first in the next iteration under the then-current policy. lambda = 1 waits for
     every trajectory.
  3. Every complete group (all K samples finished) goes to optimization: per sample the reward r (the hidden
     verifier's; -1 when the sample went over its token budget, below), the advantage A = r - mean of its group's
     rewards, and one row per training row of the sample: its tokens, the sampled ones trained against their
     recorded behaviour log-probs (k3.rl.loss: Kimi K2.5's per-token objective, or the clipped PPO baseline).
  4. Before the trainer runs, the paused trajectories' prefixes are written back to host memory and the rollout
     engine is dropped; after the update, a fresh engine fetches them back (no re-prefill).

Reasoning-effort budget control (§4.1.2): with `budget_tau`, each training problem x has an initial budget b0(x),
the mean T(y) of K samples of the starting model (measured before step 1, written to OUT/budgets.json; or given);
a trajectory with T(y) > tau_b * b0(x) gets reward -1. T(y) is the sampled tokens of the whole trajectory for
agentic tasks (a task with tools) and the thinking tokens for general ones. tau_b anneals linearly from
`budget_tau[0]` to `budget_tau[1]` over the run (`--budget-tau 4:1.5`). The effort level itself is the chat
template's thinking-effort option (`--effort`).

Held-out evaluation: every `eval_every` steps, each held-out task (the test split) is played `eval_samples` times
(greedy by default) by the current policy; `val_loss` is the failure rate (1 - success), `val_success`,
`val_reward` and per family figures are logged beside it.

A resumed run continues the optimizer, the task order and the budgets; the trajectories that were in flight are
started again (their sandboxes and processes do not survive a process).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from k3.env.episode import Episode
from k3.env.task import Task
from k3.files import atomic_write_text
from k3.rl.loss import IGNORE, RLLoss, RLLossConfig
from k3.rl.rollout import AgentRollouts, RolloutConfig, Sample, Throttle
from k3.run_dir import holding_run_dir
from k3.train.trainer import StepMetrics, Trainer, TrainConfig, TrainingError

CPU_DEFAULTS = dict(lr=2e-4)
GPU_DEFAULTS = dict(lr=2e-5)


@dataclass
class RLOptions:
    ckpt: str | None = None
    tasks: list[str] = field(default_factory=list)  # FAMILY[:N], the training split
    heldout: list[str] = field(default_factory=list)  # FAMILY[:N], the test split
    harness: Any = "react"
    resume: bool = False
    groups: int = 8  # N: prompts per iteration
    samples: int = 4  # K: samples per prompt
    lam: float = 1.0  # lambda: the finished fraction of N x K that pauses generation
    loss: RLLossConfig = field(default_factory=RLLossConfig)
    max_turn_tokens: int = 256
    max_context: int = 4096  # tokens per trajectory row (prompt, turns, tool results)
    effort: str | None = None
    budget_tau: tuple[float, float] | None = None  # (start, end) of the budget multiplier; None: no budget control
    budgets: str | None = None  # a JSON file {task id: b0}; None: measured before step 1
    eval_samples: int = 1
    eval_temperature: float = 0.0
    sandbox: str = "bwrap"
    task_seed: int = 0
    cache_memory_mb: float = 256.0
    concurrency: int = 64  # the throttle's start (and ceiling with --fixed-concurrency)
    fixed_concurrency: bool = False
    write_back: bool = True
    tool_workers: int = 4
    device: str = "auto"
    backends: Any = None
    verify: bool = True

    def validate(self) -> None:
        for name in ("groups", "samples", "max_turn_tokens", "max_context", "eval_samples", "concurrency",
                     "tool_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"rl option '{name}' = {v!r} is invalid: must be an integer >= 1")
        if self.samples < 2:
            raise ValueError(f"--samples {self.samples}: the group-mean baseline needs K >= 2 samples per prompt")
        if not 0 < self.lam <= 1:
            raise ValueError(f"--lam {self.lam!r} is invalid: the finished fraction that pauses rollouts, in (0, 1]")
        if self.budget_tau is not None and not all(t > 0 for t in self.budget_tau):
            raise ValueError(f"--budget-tau {self.budget_tau!r} is invalid: multipliers must be > 0")
        if self.eval_temperature not in (0.0, 1.0):
            raise ValueError("--eval-temperature is 0 (greedy) or 1")
        if not self.tasks:
            raise ValueError("--tasks: give at least one task family (FAMILY[:N], e.g. arith:200)")
        self.loss.validate()


@dataclass
class RLStepMetrics(StepMetrics):
    reward: float = 0.0  # mean trained reward (budget penalty included)
    task_reward: float = 0.0  # mean verifier reward
    success: float = 0.0
    samples: int = 0
    groups: int = 0
    response_len: float = 0.0  # sampled tokens per trajectory
    thinking_len: float = 0.0
    turns: float = 0.0
    over_budget: int = 0
    budget_tau: float | None = None
    stale_tokens: int = 0  # trained tokens sampled by an older policy
    staleness: float = 0.0  # mean policy versions behind, per trained token
    max_staleness: int = 0
    masked_frac: float = 0.0  # trained tokens whose policy-gradient term was cut (clip)
    log_ratio_abs: float = 0.0  # mean |log pi / mu| per trained token
    max_ratio: float = 1.0
    zero_adv_groups: int = 0  # groups whose samples all had the same reward (no policy-gradient signal)
    paused: int = 0  # trajectories left in flight for the next iteration
    rollout_s: float = 0.0
    train_s: float = 0.0
    sampled_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    reprefill_avoided: int = 0
    preemptions: int = 0
    concurrency: int = 0
    families: dict = field(default_factory=dict)


class TaskSource:
    """The training tasks in a shuffled order (a new permutation each epoch, from the seed), and the workload of
    groups in flight. Stands where the Trainer expects its loader (num_rows, tokens_per_epoch, state_dict)."""

    data_flag = "--tasks"  # what the Trainer's warning about repeated data names

    def __init__(self, tasks: list[Task], samples: int, seq_len: int, seed: int = 0):
        self.tasks, self.samples, self.seed = tasks, samples, seed
        self.num_rows, self.seq_len = len(tasks) * samples, seq_len
        self.epoch, self.pos, self.next_uid, self.next_group = 0, 0, 0, 0
        self._order = self._permutation(0)
        self.active: list[list[Sample]] = []  # groups in flight, each K samples

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))

    def take(self) -> Task:
        if self.pos == len(self.tasks):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        t = self.tasks[int(self._order[self.pos])]
        self.pos += 1
        return t

    def state_dict(self) -> dict:
        # the groups in flight are not saved (their sandboxes cannot be): a resumed run draws new ones
        return {"epoch": self.epoch, "pos": self.pos, "next_uid": self.next_uid, "next_group": self.next_group}

    def load_state_dict(self, st: dict) -> None:
        self.epoch, self.pos, self.next_uid = st["epoch"], st["pos"], st["next_uid"]
        self.next_group = st["next_group"]
        self._order = self._permutation(self.epoch)
        self.active = []


def trajectory_cost(s: Sample) -> int:
    """The report's T(y): thinking tokens for a general task (no tools), all sampled tokens for an agentic one."""
    return s.output_tokens if s.task.tools != () else s.thinking_tokens


def budget_reward(reward: float, cost: int, b0: float | None, tau_b: float | None) -> float:
    """The trained reward under budget control: -1 when the trajectory's T(y) exceeds tau_b * b0(x), else the task's
    reward (no budget for the problem, or no budget control: the task's reward)."""
    if tau_b is None or b0 is None:
        return reward
    return -1.0 if cost > tau_b * b0 else reward


def group_advantages(rewards: list[float]) -> list[float]:
    """A = r - mean of the group's rewards (the group-mean baseline of Kimi K1.5/K2/K2.5)."""
    mean = float(np.mean(rewards))
    return [r - mean for r in rewards]


def family_stats(samples: list[Sample]) -> dict:
    out: dict = {}
    for fam in sorted({s.task.family for s in samples}):
        xs = [s for s in samples if s.task.family == fam]
        out[fam] = {"reward": float(np.mean([s.reward or 0.0 for s in xs])),
                    "success": float(np.mean([s.success for s in xs])), "samples": len(xs),
                    "response_len": float(np.mean([s.output_tokens for s in xs]))}
    return out


def evaluate_policy(rollouts: AgentRollouts, tasks: list[Task], make_episode, samples: int = 1, seed: int = 0) -> dict:
    """Play every task `samples` times with `rollouts` (its temperature: 0 greedy or 1) to the end; the engine is
    dropped afterwards. Returns success and reward rates overall and per family, mean sampled tokens."""
    ss = [Sample(uid=i * samples + k, group=i, task=t, episode=make_episode(t))
          for i, t in enumerate(tasks) for k in range(samples)]
    rollouts.run(ss, seed=seed)
    rollouts.park([])
    return {"success": float(np.mean([s.success for s in ss])), "reward": float(np.mean([s.reward or 0.0 for s in ss])),
            "families": family_stats(ss), "response_len": float(np.mean([s.output_tokens for s in ss])),
            "episodes": len(ss), "errors": sum(bool(s.error) for s in ss)}


class RLTrainer(Trainer):
    """The Trainer with agent rollouts as its batches and an RL objective as its loss."""

    def __init__(self, model, tcfg: TrainConfig, source: TaskSource, rollouts: AgentRollouts, opts: RLOptions,
                 make_episode, heldout: list[Task] | None = None, eval_rollouts: AgentRollouts | None = None,
                 budgets: dict | None = None, **kw):
        super().__init__(model, tcfg, source, loss=RLLoss(opts.loss), **kw)
        self.rollouts, self.opts, self.make_episode = rollouts, opts, make_episode
        self.heldout, self.eval_rollouts = list(heldout or []), eval_rollouts
        self.budgets: dict[str, float] = dict(budgets or {})
        self._info: dict = {}
        self._traj_path = os.path.join(tcfg.out, "trajectories.jsonl")

    # --- samples -------------------------------------------------------------------------------------------------
    def _new_group(self, task: Task) -> list[Sample]:
        src = self.loader
        g = src.next_group
        src.next_group += 1
        out = []
        for _ in range(self.opts.samples):
            out.append(Sample(uid=src.next_uid, group=g, task=task, episode=self.make_episode(task)))
            src.next_uid += 1
        return out

    def budget_tau(self) -> float | None:
        bt = self.opts.budget_tau
        if bt is None:
            return None
        return bt[0] + (bt[1] - bt[0]) * min(1.0, max(0.0, self.progress()))

    def measure_budgets(self) -> dict:
        """b0(x) for every training task: the mean T(y) of K samples of the current (starting) policy; written to
        OUT/budgets.json. No training happens; the engine's cache is dropped afterwards."""
        src = self.loader
        todo = [t for t in src.tasks if t.id not in self.budgets]
        if not todo:
            return self.budgets
        self.log(f"budget control: measuring b0(x) for {len(todo)} training tasks ({self.opts.samples} samples each)")
        t0 = time.perf_counter()
        samples = [Sample(uid=10**9 + i * self.opts.samples + k, group=-1, task=t, episode=self.make_episode(t))
                   for i, t in enumerate(todo) for k in range(self.opts.samples)]
        self.rollouts.run(samples, seed=self.cfg.seed * 7919 + 17)
        self.rollouts.park([])
        for t in todo:
            costs = [trajectory_cost(s) for s in samples if s.task.id == t.id]
            self.budgets[t.id] = float(np.mean(costs)) if costs else 0.0
        atomic_write_text(os.path.join(self.cfg.out, "budgets.json"), json.dumps(self.budgets, indent=1) + "\n")
        self.log(f"budget control: b0 measured in {time.perf_counter() - t0:.1f}s (mean "
                 f"{np.mean(list(self.budgets.values())):.1f} tokens); OUT/budgets.json")
        return self.budgets

    # --- held-out evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> float | None:
        if not self.heldout or self.eval_rollouts is None:
            return None
        self.eval_rollouts.version = self.rollouts.version
        ev = evaluate_policy(self.eval_rollouts, self.heldout, self.make_episode, self.opts.eval_samples,
                             seed=self.cfg.seed * 7919 + 104729)
        self._eval_extra = {"val_success": ev["success"], "val_reward": ev["reward"], "val_families": ev["families"],
                            "val_response_len": ev["response_len"]}
        self.log(f"held out: success {100 * ev['success']:.1f}% over {ev['episodes']} episodes (" + ", ".join(
            f"{f} {100 * v['success']:.1f}%" for f, v in ev["families"].items()) + ")")
        return 1.0 - ev["success"]

    # --- where a step's batch comes from ----------------------------------------------------------------------
    def _next_batch(self) -> dict:
        src, o = self.loader, self.opts
        if o.budget_tau is not None and len(self.budgets) < len(src.tasks):
            self.measure_budgets()
        while len(src.active) < o.groups:
            src.active.append(self._new_group(src.take()))
        samples = [s for g in src.active for s in g]
        target = math.ceil(o.lam * len(samples))

        def stop() -> bool:
            return (sum(s.done for s in samples) >= target
                    and any(all(s.done for s in g) for g in src.active))

        stats = self.rollouts.run(samples, stop=stop, seed=self.cfg.seed * 7919 + self.step * 131)
        complete = [g for g in src.active if all(s.done for s in g)]
        src.active = [g for g in src.active if not all(s.done for s in g)]
        self.rollouts.park([s for g in src.active for s in g])
        self.model.train()
        tau_b = self.budget_tau()
        trained, over, zero = [], 0, 0
        for g in complete:
            for s in g:
                s.train_reward = budget_reward(float(s.reward or 0.0), trajectory_cost(s),
                                               self.budgets.get(s.task.id), tau_b)
                over += int(s.train_reward == -1.0 and tau_b is not None and s.reward != -1.0)
            rs = [s.train_reward for s in g]
            zero += int(max(rs) == min(rs))
            for s, a in zip(g, group_advantages(rs)):
                s.advantage = a
                trained.append(s)
        version = self.rollouts.version
        rows = [(s, r) for s in trained for r in s.rows if r.sampled > 0]
        if not rows:
            errors = [s.error for s in trained if s.error]
            raise TrainingError(f"none of the {len(trained)} finished trajectories sampled a token: nothing to train "
                                f"on ({len(errors)} ended in an error" + (f"; the first: {errors[0]}" if errors
                                                                          else "") + ")")
        T = max(len(r.ids) for _, r in rows)
        n = len(rows)
        batch = {"input_ids": torch.zeros(n, T, dtype=torch.long), "labels": torch.full((n, T), IGNORE),
                 "segment_ids": torch.ones(n, T, dtype=torch.long), "behaviour": torch.zeros(n, T),
                 "advantage": torch.zeros(n, T), "staleness": torch.zeros(n, T, dtype=torch.long)}
        for i, (s, r) in enumerate(rows):
            L = len(r.ids)
            ids = torch.tensor(r.ids)
            ver = torch.tensor(r.versions)
            sampled = ver >= 0
            batch["input_ids"][i, :L] = ids
            batch["segment_ids"][i, :L] = 0
            batch["labels"][i, :L] = torch.where(sampled, ids, torch.full_like(ids, IGNORE))
            batch["behaviour"][i, :L] = torch.tensor(r.logprobs, dtype=torch.float32)
            batch["advantage"][i, :L] = torch.where(sampled, torch.full((L,), float(s.advantage)), torch.zeros(L))
            batch["staleness"][i, :L] = torch.where(sampled, version - ver, torch.zeros_like(ver))
        batch["labels"][:, 0] = IGNORE  # nothing predicts the first token
        self._write_trajectories(trained)
        self._info = {"samples": trained, "groups": len(complete), "over": over, "zero": zero, "tau_b": tau_b,
                      "stats": stats, "paused": sum(len(g) for g in src.active) - sum(s.done for g in src.active
                                                                                        for s in g),
                      "t_train": time.perf_counter()}
        return batch

    def _write_trajectories(self, samples: list[Sample]) -> None:
        if not self.writes_files:
            return
        with open(self._traj_path, "a", encoding="utf-8") as f:
            for s in samples:
                rec = {"step": self.step + 1, "uid": s.uid, "group": s.group, "task_id": s.task.id,
                       "family": s.task.family, "reward": s.reward, "train_reward": s.train_reward,
                       "advantage": s.advantage, "success": s.success, "output_tokens": s.output_tokens,
                       "thinking_tokens": s.thinking_tokens, "turns": s.turns, "paused": s.paused,
                       "versions": sorted(s.versions()), "error": s.error,
                       "end_reason": (s.trajectory or {}).get("end_reason"),
                       "messages": (s.trajectory or {}).get("messages")}
                f.write(json.dumps(rec) + "\n")
            f.flush()

    # --- its metrics -------------------------------------------------------------------------------------------
    def _finish_step(self, m: StepMetrics, extras: list[dict]) -> RLStepMetrics:
        if not m.skipped:
            self.rollouts.policy_changed()
        info, samples = self._info, self._info["samples"]
        toks = float(sum(float(x["tokens"]) for x in extras))
        by_st = sum(x["by_staleness"].cpu() for x in extras)
        stale_levels = torch.arange(by_st.numel())
        stats = info["stats"]
        st = dict(
            reward=float(np.mean([s.train_reward for s in samples])),
            task_reward=float(np.mean([s.reward or 0.0 for s in samples])),
            success=float(np.mean([s.success for s in samples])), samples=len(samples), groups=info["groups"],
            response_len=float(np.mean([s.output_tokens for s in samples])),
            thinking_len=float(np.mean([s.thinking_tokens for s in samples])),
            turns=float(np.mean([s.turns for s in samples])), over_budget=info["over"], budget_tau=info["tau_b"],
            stale_tokens=int(by_st[1:].sum()), staleness=float((by_st * stale_levels).sum()) / max(toks, 1),
            max_staleness=int(stale_levels[by_st > 0].max()) if bool((by_st > 0).any()) else 0,
            masked_frac=float(sum(float(x["masked"]) for x in extras)) / max(toks, 1),
            log_ratio_abs=float(sum(float(x["log_ratio_abs"]) for x in extras)) / max(toks, 1),
            max_ratio=float(max(float(x["max_ratio"]) for x in extras)), zero_adv_groups=info["zero"],
            paused=info["paused"], rollout_s=stats["rollout_s"], train_s=time.perf_counter() - info["t_train"],
            sampled_tokens=stats["sampled_tokens"], prefill_tokens=stats["prefill_tokens"],
            cached_tokens=stats["cached_tokens"], reprefill_avoided=self.rollouts.counters["prefetched_tokens"],
            preemptions=stats["preemptions"], concurrency=self.rollouts.throttle.limit,
            families=family_stats(samples))
        out = RLStepMetrics(**asdict(m), **st)
        self.log(f"step {out.step}: reward {out.reward:+.3f}, success {100 * out.success:.1f}% (" + ", ".join(
            f"{f} {100 * v['success']:.0f}%" for f, v in out.families.items()) + f"), {out.groups} groups, length "
            f"{out.response_len:.0f}, staleness {out.staleness:.2f}, masked {100 * out.masked_frac:.1f}%, loss "
            f"{out.loss:+.4f}, rollout {out.rollout_s:.1f}s, train {out.train_s:.1f}s, {out.paused} paused")
        return out

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["rollout_version"] = self.rollouts.version
        st["budgets"] = dict(self.budgets)
        return st

    def load_state_dict(self, st: dict) -> None:
        super().load_state_dict(st)
        self.rollouts.version = st["rollout_version"]
        self.budgets = dict(st.get("budgets") or {})

    def close(self) -> None:
        self.rollouts.close()
        if self.eval_rollouts is not None:
            self.eval_rollouts.close()
        for g in self.loader.active:  # the sandboxes of trajectories still in flight
            for s in g:
                if not s.done and s.episode.sandbox is not None:
                    try:
                        s.episode.sandbox.close()
                    except Exception:
                        pass


# --- building a run -------------------------------------------------------------------------------------------

def rl_train_config(opts: RLOptions, tcfg: TrainConfig) -> TrainConfig:
    """One row per trajectory row (up to max_context tokens), N x K rows per step."""
    tcfg.seq_len = opts.max_context
    tcfg.batch_tokens = opts.groups * opts.samples * opts.max_context
    return tcfg


def build_rl_run(opts: RLOptions, tcfg: TrainConfig, log=print) -> RLTrainer:
    from k3.env.presets import load_harness
    from k3.env.run import task_instances
    from k3.posttrain.sft import load_fp32_base, prepare_run_dir
    from k3.serve.chat import chat_template_json
    from k3.serve.engine import EngineConfig
    from k3.train.run import _tokenizer_json_bytes

    opts.validate()
    rl_train_config(opts, tcfg)
    tcfg.validate()
    harness = load_harness(opts.harness)
    tasks = task_instances(opts.tasks, "train", opts.task_seed)
    heldout = task_instances(opts.heldout, "test", opts.task_seed) if opts.heldout else []
    device, resume_from = prepare_run_dir(tcfg, opts.device, opts.resume, log)
    src = resume_from or opts.ckpt
    if src is None:
        raise ValueError("--ckpt: give the checkpoint to train (an SFT cold start)")
    model, tok, template = load_fp32_base(src, device, opts.backends, opts.verify, what="--ckpt ", qat=tcfg.qat)
    torch.manual_seed(tcfg.seed)

    kernel_device = "cuda" if device.type == "cuda" else "cpu"  # kernel tasks are scored where the model runs

    def make_episode(task: Task) -> Episode:
        return Episode(task, harness, None, sandbox_kind=opts.sandbox, kernel_device=kernel_device)

    ecfg = EngineConfig(cache_memory_mb=opts.cache_memory_mb, page_tokens=256, hash_block_tokens=64,
                        cuda_graphs=False, max_model_len=opts.max_context)
    rcfg = RolloutConfig(harness=harness, sandbox_kind=opts.sandbox, max_turn_tokens=opts.max_turn_tokens,
                         effort=opts.effort, temperature=1.0, tool_workers=opts.tool_workers,
                         write_back=opts.write_back, autocast_bf16=tcfg.autocast_bf16)
    throttle = Throttle(start=opts.concurrency, hi=max(opts.concurrency, 1024) if not opts.fixed_concurrency
                        else opts.concurrency, fixed=opts.fixed_concurrency)
    rollouts = AgentRollouts(model, tok, template, rcfg, ecfg, throttle, log=log)
    eval_rollouts = None
    if heldout:
        eval_rollouts = AgentRollouts(model, tok, template, replace(rcfg, temperature=opts.eval_temperature,
                                                                    write_back=False),
                                      replace(ecfg), Throttle(start=opts.concurrency, fixed=True), log=log)
    budgets = None
    if opts.budgets:
        with open(opts.budgets, encoding="utf-8") as f:
            budgets = json.load(f)
        if not isinstance(budgets, dict) or not all(isinstance(v, (int, float)) for v in budgets.values()):
            raise ValueError(f"--budgets {opts.budgets}: expected a JSON object {{task id: tokens}}")
    source = TaskSource(tasks, opts.samples, opts.max_context, seed=tcfg.seed)
    trainer = RLTrainer(model, tcfg, source, rollouts, opts, make_episode, heldout=heldout,
                        eval_rollouts=eval_rollouts, budgets=budgets, eos_id=tok.eos_id,
                        tokenizer_json=_tokenizer_json_bytes(tok), log=log,
                        extra_files={"chat_template.json": chat_template_json(template).encode("utf-8")})
    if resume_from is not None:
        trainer.load(resume_from, verify=opts.verify)
        log(f"resumed from {resume_from} at step {trainer.step} (trajectories in flight are started again)")
    fams = {}
    for t in tasks:
        fams[t.family] = fams.get(t.family, 0) + 1
    log(f"policy: {src} on {device}{f', QAT {tcfg.qat}' if tcfg.qat else ''}; tasks: " +
        ", ".join(f"{f} {n}" for f, n in fams.items()) + f"; {len(heldout)} held out; harness {harness.name}; "
        f"N={opts.groups} x K={opts.samples}, lambda {opts.lam:g}; loss {opts.loss.kind}")
    return trainer


def run_rl(opts: RLOptions, tcfg: TrainConfig, progress_bar: bool = True, log=print) -> dict:
    with holding_run_dir(tcfg.out):
        trainer = build_rl_run(opts, tcfg, log)
        try:
            summary = trainer.fit(progress_bar=progress_bar)
        finally:
            trainer.close()
        if tcfg.qat is not None:
            from k3.train.qat import export_run

            summary["export"] = export_run(trainer, log)
    from k3.rl.report import plot_rl

    try:
        plot_rl(os.path.join(tcfg.out, "metrics.jsonl"), os.path.join(tcfg.out, "reward.png"))
    except Exception as e:  # a plot never fails a run
        log(f"(could not draw reward.png: {e})")
    recs = [h for h in trainer.history if "reward" in h]
    vals = [h for h in trainer.history if "val_success" in h]
    if recs:
        summary["first_reward"], summary["last_reward"] = recs[0]["reward"], recs[-1]["reward"]
    if vals:
        summary["first_val_success"], summary["last_val_success"] = vals[0]["val_success"], vals[-1]["val_success"]
    msg = f"stopped at step {summary['step']}" if summary.get("interrupted") else f"finished at step {summary['step']}"
    if recs:
        msg += f": reward {summary['first_reward']:+.3f} -> {summary['last_reward']:+.3f}"
    if vals:
        msg += f", held-out success {100 * vals[0]['val_success']:.1f}% -> {100 * vals[-1]['val_success']:.1f}%"
    log(f"{msg}; checkpoint {summary['checkpoint']}")
    return summary
