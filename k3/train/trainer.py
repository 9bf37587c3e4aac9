"""The training loop: data -> model -> loss -> Per-Head Muon step -> QK-Clip -> Quantile Balancing, with metrics,
atomic checkpoints and exact resume (checkpoints: k3.train.checkpointing; held-out loss: k3.train.evaluate;
metrics.jsonl, loss.png and the progress bar: k3.train.reporting).

One loop for every kind of run: pre-training and SFT train `NextTokenLoss`, MOPD its policy-gradient loss
(k3.posttrain.distill), RL its own (k3.rl.trainer), the EAGLE-3 draft its training-time-test loss
(k3.posttrain.eagle3); a run supplies its batches (the loader, or `_next_batch`) and its loss (k3.train.losses:
one call per micro-batch), and the micro-batch loop, autocast, weight casts, statistics, OOM retry, distributed
hooks and checkpoints are this file's.

The trained module is a K3ForCausalLM, or any module with a `config` (its vocab_size), `backends` and parameters:
what the Trainer does beyond the loss follows from what the module has and the settings ask for (Quantile
Balancing of its LatentMoE layers unless --balance none, QK-Clip when qk_clip_tau > 0, activation checkpointing
when the module has it; a context schedule's stages, k3.train.context_schedule, change the row length and the
checkpointing between steps). A run whose module is not a K3ForCausalLM writes and reads it in checkpoints itself
(`_save_model`, `_load_model`).

The loop is single-device code. Everything a distributed wrapper needs to change is a constructor argument
(the model, the process group for balancing) or a method to override (`_all_reduce_grads`); there is no
global state.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import record_function

from k3.checkpoint import load_state_into, save_pretrained
from k3.model.batch import BatchInfo
from k3.model.common import use_weight_casts
from k3.model.latent_moe import LatentMoE
from k3.model.model import check_token_ids
from k3.ops.weight_cast import WeightCasts
from k3.run_dir import clean_interrupted, holding_run_dir
from k3.train import state as state_io
from k3.train.checkpointing import checkpoint_path, load_checkpoint, save_checkpoint
from k3.train.config import TrainConfig
from k3.train.evaluate import eval_extent, evaluate_batches, evaluate_loss
from k3.train.losses import Loss, LossOutput, MicroBatch, NextTokenLoss
from k3.train.per_head_muon import PerHeadMuon, optimizer_groups
from k3.train.qk_clip import MaxLogitTracker, apply_qk_clip_
from k3.train.quantile_balance import ExpertBalancer, idle_expert_counts, ideal_load_ratios, load_ratios
from k3.train.reporting import MetricsLog, ProgressBar, plan_messages, projection_messages
from k3.train.schedule import lr_multiplier
from k3.tensors import to_device_async


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
PROJECT_AT = 10  # a run bounded by time alone projects its epochs from its speed over this many steps
# A second stop signal within this many seconds of the first is the same request: `timeout` signals the process and
# then its whole process group (so the process gets it twice), as a terminal's Ctrl-C reaches every process of the
# foreground group. Only a signal after that aborts without saving.
SIGNAL_REPEAT_S = 1.0


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. repeated non-finite losses); the last good checkpoint is intact."""


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    elapsed_s: float
    mtp_loss: float | None = None
    max_logit: float | None = None
    clipped_heads: int = 0
    expert_load_max_over_mean: list[float] = field(default_factory=list)
    # with balance_diagnostics: per MoE layer, busiest / mean load of the batch routed with the bias computed from it
    expert_load_ideal_max_over_mean: list[float] | None = None
    # with balance_diagnostics: per MoE layer, how many experts got no token in the step
    experts_without_tokens: list[int] | None = None
    skipped: bool = False
    # with --context-schedule: the step's stage (0-based) and row length (k3.train.context_schedule)
    stage: int | None = None
    seq_len: int | None = None


class Trainer:
    def __init__(self, model: torch.nn.Module, tcfg: TrainConfig, train_loader, eval_stream=None, eos_id: int = 0,
                 tokenizer_json: bytes | None = None, log=print, extra_files: dict[str, bytes] | None = None,
                 loss: Loss | None = None):
        """`eval_stream`: the held-out token stream (windows of seq_len), or a list of labelled batches (SFT rows);
        `extra_files`: written into every checkpoint beside the tokenizer (e.g. the chat template); `loss`: what
        each micro-batch trains (k3.train.losses; default: next-token cross-entropy + mtp_weight x MTP)."""
        tcfg.validate()
        self.model, self.cfg, self.loader = model, tcfg, train_loader
        self.loss = loss if loss is not None else NextTokenLoss(tcfg.mtp_weight)
        self.eval_stream, self.eos_id, self.tokenizer_json, self.log = eval_stream, eos_id, tokenizer_json, log
        self.extra_files = dict(extra_files or {})
        self.device = torch.device(tcfg.device)
        self.optimizer = PerHeadMuon(optimizer_groups(model, tcfg.optimizer), lr=tcfg.lr,
                                     weight_decay=tcfg.weight_decay, backends=model.backends)
        # Training forwards only: evaluation (eval mode, no_grad) runs the plain path whatever the setting.
        if hasattr(model, "set_activation_checkpointing"):
            model.set_activation_checkpointing(tcfg.activation_checkpointing)
        elif tcfg.activation_checkpointing:
            raise ValueError(f"activation checkpointing: the trained module ({type(model).__name__}) has none")
        self.moe_layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
        # no balancers for --balance none, unless its loads are to be measured (diagnostics: method "none")
        self.balancers = [] if tcfg.balance == "none" and not tcfg.balance_diagnostics else [
            ExpertBalancer(m.gate.e_score_correction_bias.numel(), m.gate.top_k, method=tcfg.balance,
                           diagnostics=tcfg.balance_diagnostics)
            for m in self.moe_layers]
        # QK-Clip's per-head maxima over each step's training forwards (never an evaluation's)
        clip_on = tcfg.qk_clip_tau is not None and tcfg.qk_clip_tau > 0
        self.max_logits = MaxLogitTracker(model) if clip_on else None
        # what the training forwards return besides the loss: routing for balancing, max logits for QK-Clip
        self.forward_stats = (("routing",) if self.balancers else ()) + (("max_logit",) if clip_on else ())
        self.step = 0
        self.elapsed = 0.0  # seconds of training (excluding evaluation), carried across resumes
        self.bad_steps = 0
        self.history: list[dict] = []
        self._stop_requested = False
        self._stop_signal: str | None = None  # "SIGINT" / "SIGTERM" once a signal asked the run to stop
        self._stop_at: float | None = None  # time.monotonic() of that signal
        self._eval_extra: dict = {}  # what the last evaluation adds to its record beside val_loss (eval_record)
        self._saved_step: int | None = None  # the step whose checkpoint is on disk (nothing changed since)
        # Seconds from the start of the run to the trainer (data, tokenizer, model; set by the run's builder, for the
        # time-to-first-step line), and how much longer this session's first step took than its second (kernel
        # compilation, autotuning, allocator warm-up), which `elapsed` and so --max-minutes do not count.
        self.setup_s: float | None = None
        self.warmup_s = 0.0
        self.writes_files = True  # metrics.jsonl, loss.png, the progress bar (one process of a distributed run)
        self._stage_applied: int | None = None  # the context stage whose settings the model runs with
        self.retries_oom = True  # out of memory: halve the micro-batch and retry (not on one rank of many)

    # --- schedule ----------------------------------------------------------------------------
    def step_budget(self) -> int | None:
        """The step the run ends at by --max-steps or --epochs, whichever is smaller (None: neither is set).
        --epochs N is the steps whose batches hold N times the loader's rows, rounded up."""
        c = self.cfg
        steps = [] if c.max_steps is None else [c.max_steps]
        if c.epochs is not None:
            steps.append(max(1, math.ceil(c.epochs * self.loader.num_rows / c.rows_per_step)))
        return min(steps) if steps else None

    def epochs_seen(self) -> float:
        return self.step * self.cfg.rows_per_step / self.loader.num_rows

    def progress(self) -> float:
        """Fraction of the run done: by steps when --max-steps or --epochs is set, otherwise by training time."""
        budget = self.step_budget()
        if budget is not None:
            return self.step / budget
        return self.elapsed / (60 * self.cfg.max_minutes)

    def context_stage(self) -> int:
        """The context stage of the next step (k3.train.context_schedule: by the step budget, else by training
        time), never before the loader's current stage."""
        from k3.train.context_schedule import stage_at_progress, stage_at_step

        stages, budget = self.cfg.context_schedule, self.step_budget()
        k = (stage_at_step(stages, self.step, budget) if budget is not None
             else stage_at_progress(stages, self.progress()))
        return max(k, self.loader.stage)

    def _enter_stage(self) -> None:
        """With a context schedule: move the loader to the next step's stage when it changes (a fresh stream of rows
        of the stage's length, --batch-tokens / length a step) and run the model with the stage's activation
        checkpointing."""
        from k3.train.context_schedule import checkpointing_for

        c = self.cfg
        k = self.context_stage()
        if k == self._stage_applied:
            return
        moved = k != self.loader.stage
        self.loader.enter(k)
        stages = c.context_schedule
        ckpt = checkpointing_for(stages, k, c.batch_tokens, c.micro_batch_rows, c.activation_checkpointing,
                                 c.activation_checkpointing_from)
        if hasattr(self.model, "set_activation_checkpointing"):
            self.model.set_activation_checkpointing(ckpt)
        elif ckpt:
            raise ValueError(f"activation checkpointing: the trained module ({type(self.model).__name__}) has none")
        length = stages[k][0]
        long = getattr(self.loader.current, "share", None)
        self.log(f"context stage {k + 1}/{len(stages)} {'from' if moved or self.step == 0 else 'continued at'} step "
                 f"{self.step + 1}: rows of {length:,} tokens, {c.batch_tokens // length} a step"
                 f"{f', {long:.0%} of them from long documents' if long else ''}"
                 f", activation checkpointing {'on' if ckpt else 'off'}")
        self._stage_applied = k

    def done(self) -> bool:
        c = self.cfg
        budget = self.step_budget()
        if budget is not None and self.step >= budget:
            return True
        return c.max_minutes is not None and self.elapsed >= 60 * c.max_minutes

    # --- one step ------------------------------------------------------------------------------
    def train_step(self) -> StepMetrics:
        c, model = self.cfg, self.model
        model.train()
        t0 = time.perf_counter()
        mult = lr_multiplier(self.progress(), c.warmup_frac, c.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * mult
        if c.context_schedule is not None:
            self._enter_stage()
        batch = self._next_batch()
        rows, length = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        n_tokens = int((batch["labels"][:, 1:] != -100).sum())
        bias_now = [m.gate.e_score_correction_bias.clone() for m in self.moe_layers]
        while True:
            mb = min(c.micro_batch_rows or rows, rows)
            try:
                loss_sum, mtp_sum, extras = self._accumulate(batch, mb, bias_now)
                break
            except _OOM:
                pass
            # Outside the handler, so the failed attempt's activations are already released: drop this step's
            # partial gradients and routing statistics and retry the same batch in micro-batches of half the
            # rows (the step's result is the same up to summation order).
            self.optimizer.zero_grad(set_to_none=True)
            for bal in self.balancers:
                bal.discard()
            if self.max_logits is not None:
                self.max_logits.discard()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if not self.retries_oom:
                raise TrainingError(
                    f"out of {self.device.type} memory with {mb}-row micro-batches on one rank of a distributed run, "
                    "where one rank cannot retry alone (the others wait in its collectives); rerun with a smaller "
                    "--micro-batch-rows or --activation-checkpointing (the last checkpoint is intact)")
            if mb == 1:
                raise TrainingError(
                    f"out of {self.device.type} memory even with 1-row micro-batches of {length} tokens; "
                    "use --activation-checkpointing or a shorter --seq-len (the last checkpoint is intact)")
            c.micro_batch_rows = mb // 2
            self.log(f"step {self.step + 1}: out of memory with {mb}-row micro-batches; "
                     f"retrying with {c.micro_batch_rows} rows (kept for the rest of the run)")
        self._all_reduce_grads()
        has_mtp = mtp_sum is not None
        loss_sum, mtp_sum = self._reduce_losses(loss_sum, mtp_sum if has_mtp else torch.zeros_like(loss_sum))
        with record_function("k3.train.grad_clip"):
            grad_norm = self._clip_grad_norm()
        clip_on = self.max_logits is not None
        maxima = self.max_logits.consume() if clip_on else []
        # One read from the device per step: the losses, the gradient norm, the expert loads and the MLA maxima
        # together, so the host waits for the device once (here, before the optimizer) instead of once for each.
        loss_sum, mtp_sum, grad_norm, loads, maxima = self._read_back(loss_sum, mtp_sum, grad_norm,
                                                                       load_ratios(self.balancers), maxima)
        metrics = StepMetrics(step=self.step + 1, loss=loss_sum, lr=self.optimizer.param_groups[0]["lr"],
                              grad_norm=grad_norm, tokens_per_s=0.0, elapsed_s=0.0,
                              mtp_loss=mtp_sum if has_mtp else None)
        if c.context_schedule is not None:
            metrics.stage, metrics.seq_len = self.loader.stage, length
        if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
            # Skip: no parameter, bias or optimizer state changes; the data position moves on.
            self.optimizer.zero_grad(set_to_none=True)
            for bal, b in zip(self.balancers, bias_now):
                bal.update(b)  # discard this window's statistics (the returned bias is not applied)
            self.bad_steps += 1
            metrics.skipped = True
            self.log(f"step {self.step + 1}: non-finite loss or gradient (loss={loss_sum}, grad norm={grad_norm}); "
                     f"step skipped ({self.bad_steps} in a row)")
            if self.bad_steps >= c.max_bad_steps:
                raise TrainingError(f"{self.bad_steps} consecutive steps had non-finite loss or gradients; stopping. "
                                    "The last good checkpoint is intact; try a lower --lr.")
        else:
            self.bad_steps = 0
            with record_function("k3.train.optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if clip_on:
                with record_function("k3.train.qk_clip"):
                    clip = self._apply_qk_clip(maxima)
                metrics.max_logit, metrics.clipped_heads = clip["max_logit"], clip["clipped_heads"]
            # Quantile Balancing: the bias computed from this step's routing applies from the next step on.
            with torch.no_grad(), record_function("k3.train.balance"):
                for bal, m in zip(self.balancers, self.moe_layers):
                    m.gate.e_score_correction_bias.copy_(bal.update(m.gate.e_score_correction_bias))
            if c.balance_diagnostics:
                metrics.expert_load_ideal_max_over_mean = ideal_load_ratios(self.balancers)
                metrics.experts_without_tokens = idle_expert_counts(self.balancers)
        metrics.expert_load_max_over_mean = loads
        self.step += 1
        dt = time.perf_counter() - t0
        self.elapsed += dt
        metrics.tokens_per_s = n_tokens / max(dt, 1e-9)
        metrics.elapsed_s = self.elapsed
        return self._finish_step(metrics, extras)

    def _finish_step(self, metrics: StepMetrics, extras: list[dict]) -> StepMetrics:
        """The step's record: the Trainer's metrics, completed by a run whose loss returns statistics (`extras`: its
        `LossOutput.extra` of each micro-batch, device tensors, read back here; k3.posttrain.distill)."""
        return metrics

    def _read_back(self, loss: torch.Tensor, mtp: torch.Tensor, grad_norm: torch.Tensor, loads: list,
                   maxima: list) -> tuple:
        """(loss, MTP loss, gradient norm) as floats, each MoE layer's max / mean expert load (NaN when it
        observed nothing) and the MLA maxima on the host, from one device-to-host copy."""
        dev = loss.device
        parts = [loss.reshape(1), mtp.reshape(1), grad_norm.double().reshape(1).to(dev)]
        parts += [r[:1].to(dev) for r in loads if r is not None]
        parts += [t.double().reshape(-1).to(dev) for t in maxima if t is not None]
        vals = torch.cat(parts).cpu()
        out_loads, off = [], 3
        for r in loads:
            out_loads.append(float("nan") if r is None else float(vals[off]))
            off += r is not None
        host_maxima = []
        for t in maxima:
            if t is None:
                host_maxima.append(None)
                continue
            host_maxima.append(vals[off:off + t.numel()].float())
            off += t.numel()
        return float(vals[0]), float(vals[1]), float(vals[2]), out_loads, host_maxima

    def _accumulate(self, batch: dict, mb: int, bias_now: list) -> tuple[torch.Tensor, torch.Tensor | None, list]:
        """Forward + backward of the whole batch in micro-batches of `mb` rows through the run's loss
        (k3.train.losses), which weighs each micro-batch so that their gradients sum to the step's. Returns the
        batch's loss and MTP loss (None: the loss has none) as fp64 device scalars (not read back: the step reads
        everything it needs at once), and the loss's statistics of each micro-batch."""
        c, model = self.cfg, self.model
        rows = batch["input_ids"].shape[0]
        # Losses stay on the device until every micro-batch is launched: reading one back after each backward
        # would stall the host until the GPU drained, so the next micro-batch could not be queued behind it.
        losses, mtps, extras = [], [], []
        check_token_ids(batch["input_ids"], model.config.vocab_size)  # here, on the host copy (no device read)
        tokens = self._step_tokens(batch)
        # Under autocast the weights are cast once for all micro-batches and their gradients summed straight into
        # the fp32 .grad (bitwise what autograd's cast + accumulation gives; k3.ops.weight_cast).
        with use_weight_casts(model, self._weight_casts()):
            for s in range(0, rows, mb):
                host = {k: v[s:s + mb] for k, v in batch.items()}
                info, part, scale = self._micro_batch(host)
                micro = MicroBatch(part, info, self.forward_stats, host["input_ids"].shape[0] / rows, tokens)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=c.autocast_bf16), \
                        record_function("k3.train.forward"):
                    out: LossOutput = self.loss(model, micro)
                with record_function("k3.train.backward"):
                    (out.loss * scale).backward()
                losses.append(out.value)
                if out.mtp is not None:
                    mtps.append(out.mtp)
                extras.append(out.extra)
                if self.max_logits is not None:
                    self.max_logits.observe(out.stats)
                for bal, m, b in zip(self.balancers, self.moe_layers, bias_now):
                    routing = out.stats.routing.get(m.layer_idx)
                    if routing is not None:  # an MTP depth longer than the micro-batch did not run
                        bal.observe(routing, b)
        return torch.stack(losses).sum(), (torch.stack(mtps).sum() if mtps else None), extras

    def _step_tokens(self, batch: dict) -> torch.Tensor:
        """`MicroBatch.step_tokens` of the step's batch: its trained tokens (labels past position 0), fp32 on the
        device (not read back)."""
        tokens = torch.tensor(float((batch["labels"][:, 1:] != -100).sum()), dtype=torch.float32)
        return to_device_async(tokens, self.device)

    def _micro_batch(self, host: dict) -> tuple[BatchInfo, dict, float]:
        """(the micro-batch's record, its tensors on the device (all but the document ids: token ids, labels and
        whatever per-token tensors the run's loss reads), the factor its loss is scaled by in backward). The
        record's document offsets are computed from the host copy, so the forward never waits for the device; the
        copies do not wait either."""
        info = BatchInfo.from_segment_ids(host["segment_ids"]).to(self.device)
        return info, {k: to_device_async(v, self.device) for k, v in host.items() if k != "segment_ids"}, 1.0

    def _weight_casts(self) -> WeightCasts | None:
        """The weight casts of one step's micro-batches (k3.ops.weight_cast): a fresh `WeightCasts` under bf16
        autocast, else None. A data-parallel wrapper that shards the model with FSDP2 returns None: FSDP2's
        MixedPrecisionPolicy casts the parameters for each forward itself, and reduces gradients through the
        autograd hooks that the cast cache bypasses."""
        return WeightCasts() if self.cfg.autocast_bf16 else None

    def _all_reduce_grads(self) -> None:
        """Hook for data-parallel wrappers; a single process has nothing to reduce."""

    def _next_batch(self) -> dict:
        """This process's rows of the next global batch (a single process: all of them)."""
        return self.loader.next_batch()

    def _reduce_losses(self, loss: torch.Tensor, mtp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (loss, MTP loss) over all processes, for reporting (a single process: its own)."""
        return loss, mtp

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clip the gradients to `grad_clip` in total norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)

    def _apply_qk_clip(self, maxima: list) -> dict:
        """QK-Clip with the step's per-head maxima (already all-reduced by MaxLogitTracker.consume)."""
        return apply_qk_clip_(self.model, maxima, self.cfg.qk_clip_tau)

    def _agree(self, flag: bool) -> bool:
        """A loop decision every process must take together (stop, save): a single process's own."""
        return flag

    # --- evaluation ----------------------------------------------------------------------------
    def eval_record(self) -> dict:
        """What the last `evaluate` adds to its metrics record beside val_loss (a subclass's per-domain figures)."""
        return dict(self._eval_extra)

    def eval_plan(self) -> str | None:
        """What one evaluation reads, in words ("16 batches, 65,536 tokens"), or None without held-out data."""
        if self.eval_stream is None:
            return None
        if isinstance(self.eval_stream, list):
            return f"{len(self.eval_stream)} batch{'' if len(self.eval_stream) == 1 else 'es'}"
        batches, tokens = eval_extent(len(self.eval_stream), self.cfg.seq_len, self._eval_rows(),
                                      self.cfg.eval_batches)
        return f"{batches} batch{'' if batches == 1 else 'es'}, {tokens:,} of {len(self.eval_stream):,} tokens"

    def _eval_rows(self) -> int:
        return max(1, min(self.cfg.rows_per_step, 16))

    def evaluate(self) -> float | None:
        if self.eval_stream is None:
            return None
        if isinstance(self.eval_stream, list):
            return evaluate_batches(self.model, self.eval_stream, self.device, autocast_bf16=self.cfg.autocast_bf16)
        return evaluate_loss(self.model, self.eval_stream, self.cfg.seq_len, self.eos_id, self.cfg.eval_batches,
                             rows=self._eval_rows(), device=self.device,
                             autocast_bf16=self.cfg.autocast_bf16)

    # --- checkpoints (k3.train.checkpointing writes and reads them) ----------------------------------
    def state_dict(self) -> dict:
        """Everything besides the weights that exact resume needs."""
        return {
            "step": self.step, "elapsed": self.elapsed, "bad_steps": self.bad_steps,
            "optimizer": self.optimizer.state_dict(),
            "balancers": [b.state_dict() for b in self.balancers],
            "loader": self.loader.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "train_config": asdict(self.cfg),
        }

    def load_state_dict(self, st: dict) -> None:
        self.step, self.elapsed, self.bad_steps = st["step"], st["elapsed"], st["bad_steps"]
        self.optimizer.load_state_dict(st["optimizer"])
        for b, s in zip(self.balancers, st["balancers"]):
            b.load_state_dict(s)
        self.loader.load_state_dict(st["loader"])
        torch.set_rng_state(st["torch_rng"])

    def save(self) -> str:
        path = checkpoint_path(self.cfg.out, self.step)
        if self._saved_step == self.step and os.path.isdir(path):
            return path  # e.g. the final save right after a periodic one: rewriting it would only add risk
        state = state_io.dump_parts(self.state_dict())
        save_checkpoint(self.model, self.cfg.out, self.step, state, tokenizer_json=self.tokenizer_json,
                        keep=self.cfg.keep_checkpoints, log=self.log, extra_files=self.extra_files,
                        save_model=self._save_model)
        self._saved_step = self.step
        return path

    def _save_model(self, model, path: str, extra_files: dict) -> None:
        """Write the trained module and `extra_files` (the trainer state, the tokenizer, ...) as the checkpoint
        directory `path`, atomically: the official layout (k3.checkpoint.save_pretrained). A run of another module
        writes its own (k3.checkpoint.write_checkpoint_dir), and reads it in `_load_model`."""
        save_pretrained(model, path, extra_files=extra_files)

    def _load_model(self, model, path: str, verify: bool) -> None:
        """Fill the trained module from the checkpoint `path` that `_save_model` wrote."""
        load_state_into(model, path, verify=verify)

    def load(self, ckpt_dir: str, verify: bool = True) -> None:
        """Restore model and trainer state from a checkpoint; `verify`: check the shards' SHA-256 digests."""
        stored = load_checkpoint(self.model, ckpt_dir, verify=verify, load_model=self._load_model)
        try:
            self.load_state_dict(state_io.loads(*stored))
        except Exception as e:
            raise TrainingError(f"trainer state in {ckpt_dir} is unreadable ({type(e).__name__}: {e}); "
                                "the checkpoint is damaged") from None
        if os.path.abspath(ckpt_dir) == os.path.abspath(checkpoint_path(self.cfg.out, self.step)):
            self._saved_step = self.step  # resuming from this run's own checkpoint of this step

    def _log_first_step(self, since_fit: float, eval_s: float, step_s: float) -> None:
        """Time to the first step, and what it went to (the run's setup, the first evaluation, the step itself)."""
        parts = []
        total = since_fit
        if self.setup_s is not None:
            parts.append(f"{self.setup_s:.1f}s reading the data and building the model")
            total += self.setup_s
        if eval_s:
            parts.append(f"{eval_s:.1f}s held-out evaluation")
        what = "the step itself"
        if self.device.type == "cuda":
            from k3.cli_args import compile_cache_dir

            what += f", compiling kernels on a first start (kept in {compile_cache_dir()} for the next)"
        parts.append(f"{step_s:.1f}s {what}")
        self.log(f"step {self.step} after {total:.1f}s: {', '.join(parts)}")

    # --- the loop ----------------------------------------------------------------------------------
    def fit(self, progress_bar: bool = True) -> dict:
        """Train until done or stopped by a signal, then save. Holds the run directory's lock throughout: a
        second process training in the same directory would interleave metrics.jsonl and checkpoints."""
        with holding_run_dir(self.cfg.out):
            return self._fit(progress_bar)

    def _fit(self, progress_bar: bool) -> dict:
        c = self.cfg
        if self.writes_files:
            os.makedirs(c.out, exist_ok=True)
            clean_interrupted(os.path.join(c.out, "checkpoints"), log=self.log)
        # SIGTERM (timeout, docker stop, systemd, Kubernetes) is handled as Ctrl-C: finish the step, save, exit.
        signals = (signal.SIGINT, signal.SIGTERM)
        prev_handlers = {s: signal.getsignal(s) for s in signals}

        def on_signal(signum, frame):
            now = time.monotonic()
            if self._stop_requested:
                if self._stop_at is not None and now - self._stop_at < SIGNAL_REPEAT_S:
                    return  # the same request delivered twice (see SIGNAL_REPEAT_S)
                # a second request: stop now, without saving
                self.log(f"\n{signal.Signals(signum).name} again: stopping now, without saving (the last checkpoint "
                         "stays as it is)")
                for s, h in prev_handlers.items():
                    signal.signal(s, h)
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(128 + signum)
            self._stop_requested, self._stop_at = True, now
            self._stop_signal = signal.Signals(signum).name
            again = "Ctrl-C" if signum == signal.SIGINT else self._stop_signal
            self.log(f"\n{self._stop_signal}: finishing this step, saving a checkpoint, then exiting "
                     f"({again} again to abort)")

        in_main = _is_main_thread()
        if in_main:
            for s in signals:
                signal.signal(s, on_signal)
        bar = ProgressBar(self.step_budget(), c.max_minutes, self.step, enabled=progress_bar and self.writes_files)
        per_step = c.rows_per_step * c.seq_len
        # the flag that adds data to this run (a loader of prompts or tasks names its own)
        data_flag = getattr(self.loader, "data_flag", "--data")
        for line in plan_messages(self.loader.tokens_per_epoch, per_step, self.step_budget(), c.max_minutes,
                                  self.step + PROJECT_AT, data_flag):
            self.log(line)
        first_step_end = None  # training seconds after this session's first step (compilation, warm-up excluded)
        metrics = MetricsLog(c.out, self.history, log=self.log, enabled=self.writes_files)
        if self.step > 0:
            dropped = metrics.resume_at(self.step)
            if dropped:
                self.log(f"metrics.jsonl: dropped {dropped} records after step {self.step}, the step this run "
                         "resumed from (their steps are trained again)")
        summary = {"start_step": self.step}
        if self.step > 0 and metrics.last_val_loss is not None:  # the run's held-out loss before this resume
            summary["first_val_step"], summary["first_val_loss"] = metrics.last_val_loss
        t_fit, eval_s, first_dt, first_counted = time.perf_counter(), 0.0, None, False
        try:
            with metrics:
                if self.step == 0:
                    plan = self.eval_plan()
                    if plan is not None:
                        self.log(f"held-out evaluation before step 1: {plan} (--eval-batches caps it) ...")
                    t0 = time.perf_counter()
                    val = self.evaluate()
                    eval_s = time.perf_counter() - t0
                    if val is not None:
                        self.log(f"held-out loss at step 0: {val:.4f} ({eval_s:.1f}s)")
                        metrics.record({"step": 0, "val_loss": val, "elapsed_s": 0.0, **self.eval_record()})
                        summary["first_val_loss"] = val
                last_save = time.monotonic()
                while not self._agree(self.done() or self._stop_requested):
                    before = self.elapsed
                    m = self.train_step()
                    dt = self.elapsed - before
                    if first_dt is None:
                        # This session's first step also compiles kernels, autotunes and warms the allocator: it is
                        # counted at the second step's time once that is known (not now, so that a long compilation
                        # does not end a --max-minutes run), the difference reported as warm-up.
                        first_dt = dt
                        self.elapsed = m.elapsed_s = before
                        self._log_first_step(time.perf_counter() - t_fit, eval_s, first_dt)
                    elif not first_counted:
                        first_counted = True
                        self.warmup_s = max(0.0, first_dt - dt)
                        self.elapsed += min(first_dt, dt)
                        first_step_end += min(first_dt, dt)  # the projection's rate: from the second step on
                        m.elapsed_s = self.elapsed
                        if self.warmup_s >= 1.0:
                            self.log(f"warm-up: step {self.step - 1} took {first_dt:.1f}s, step {self.step} "
                                     f"{dt:.1f}s; the {self.warmup_s:.1f}s difference (compilation, autotuning) is "
                                     "not counted as training time (--max-minutes)")
                    if first_step_end is None:
                        first_step_end, first_step = self.elapsed, self.step
                    elif self.step == first_step + PROJECT_AT - 1 and self.step_budget() is None:
                        rate = (self.elapsed - first_step_end) / (self.step - first_step)
                        for line in projection_messages(self.loader.tokens_per_epoch, per_step, self.step,
                                                        self.elapsed, rate, c.max_minutes, data_flag):
                            self.log(line)
                    rec = {k: v for k, v in asdict(m).items() if v is not None}
                    if self.step % c.eval_every == 0 or self.done():
                        val = self.evaluate()
                        if val is not None:
                            rec["val_loss"] = val
                            rec.update(self.eval_record())
                            summary.setdefault("first_val_loss", val)
                            summary["last_val_loss"] = val
                    if self.step % c.log_every == 0 or "val_loss" in rec or self.done():
                        metrics.record(rec)
                    summary["last_loss"] = m.loss
                    bar.update(m, self.elapsed)
                    if c.save_checkpoints and self._agree(time.monotonic() - last_save > 60 * c.save_every_minutes):
                        self.save()
                        last_save = time.monotonic()
                if first_dt is not None and not first_counted:  # one step in this session: count it whole
                    self.elapsed += first_dt
                path = self.save() if c.save_checkpoints else None
                summary.update(step=self.step, checkpoint=path, interrupted=self._stop_requested,
                               signal=self._stop_signal, epochs=self.epochs_seen(), warmup_s=self.warmup_s)
        finally:
            bar.close()
            if in_main:
                for s, h in prev_handlers.items():
                    signal.signal(s, h)
        metrics.plot()
        return summary


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
