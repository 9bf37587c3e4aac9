"""`TrainConfig`: the settings of a training run (`k3 train`, `k3 sft`, `k3 distill`), plain data validated at the
edge; a checkpoint's trainer state keeps it, so that a resumed run trains the same way."""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3.train.context_schedule import DEFAULT_LONG_DOC_SHARE, check_context_schedule
from k3.train.per_head_muon import OPTIMIZERS


@dataclass
class TrainConfig:
    out: str = "runs/k3"
    max_steps: int | None = None
    max_minutes: float | None = None
    epochs: float | None = None  # passes over the training data; with the two above, whichever ends first
    seq_len: int = 256
    batch_tokens: int = 8192  # tokens per optimizer step
    micro_batch_rows: int | None = None  # rows per forward/backward (None: the whole batch at once)
    lr: float = 3e-3  # peak Muon and AdamW learning rate
    warmup_frac: float = 0.01
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    balance: str = "histogram"  # histogram | exact | sign | none
    # Per MoE layer and step, also the load imbalance of the step's batch routed again with the bias computed from
    # it (the same-batch ideal, k3.train.quantile_balance): tells batch-to-batch variation from balancing error.
    # Keeps the routing scores of the step and reads one more value per layer back; off by default.
    balance_diagnostics: bool = False
    # "per-head-muon" (K3's), "muon" (whole-matrix Muon) or "adamw" (k3.train.per_head_muon.optimizer_groups): the
    # optimizers the report's §2.5 compares
    optimizer: str = "per-head-muon"
    qk_clip_tau: float = 100.0
    eval_every: int = 50
    # x up to 16 rows x seq_len tokens: the whole held-out set of the default corpus (`k3 train --eval-batches`; 16 on
    # a CPU, k3.train.run.CPU_DEFAULTS); every evaluation reads the same first batches, the one before step 1 too
    eval_batches: int = 64
    save_every_minutes: float = 5.0
    keep_checkpoints: int = 2
    # False: no checkpoint is written at all (a study that keeps only metrics.jsonl; a signal then just stops)
    save_checkpoints: bool = True
    log_every: int = 1
    max_bad_steps: int = 5
    seed: int = 0
    device: str = "cpu"
    autocast_bf16: bool = False
    # Recompute each sublayer in backward instead of keeping its activations (K3ForCausalLM.
    # set_activation_checkpointing): about one extra forward of compute for much less activation memory;
    # needed for long contexts. Same losses and gradients.
    activation_checkpointing: bool = False
    # Quantization-aware training of the routed experts (k3.train.qat): "mxfp4" (MXFP4 weights, MXFP8 expert
    # inputs, straight-through gradients) or None. The run's builder applies it to the model; kept here so that a
    # resumed run trains the same way.
    qat: str | None = None
    # Progressive context extension (k3.train.context_schedule): [[seq_len, share], ...], None: --seq-len throughout.
    # With a schedule, seq_len is its first length (the held-out evaluation's length at every stage).
    context_schedule: list | None = None
    # A stage of this length or more runs with activation checkpointing (None: when one of its forwards holds more
    # tokens than one of the first stage; k3.train.context_schedule.checkpointing_for)
    activation_checkpointing_from: int | None = None
    # the share of a later stage's rows read from long documents (runs on the default corpus)
    long_doc_share: float = DEFAULT_LONG_DOC_SHARE

    def validate(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"training option '{name}' = {getattr(self, name)!r} is invalid: {allowed}")

        if self.max_steps is None and self.max_minutes is None and self.epochs is None:
            bad("max_steps", "give --max-steps, --max-minutes or --epochs (the first one reached ends the run)")
        if self.max_steps is not None and self.max_steps < 1:
            bad("max_steps", "must be >= 1")
        if self.max_minutes is not None and not self.max_minutes > 0:
            bad("max_minutes", "must be > 0")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            bad("epochs", "must be a positive number")
        if self.seq_len < 8:
            bad("seq_len", "must be >= 8")
        if self.batch_tokens < self.seq_len:
            bad("batch_tokens", f"must be >= seq_len ({self.seq_len})")
        if not self.lr > 0 or not math.isfinite(self.lr):
            bad("lr", "must be a positive number")
        for name in ("mtp_weight", "weight_decay"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                bad(name, "must be a finite number >= 0")
        if self.qk_clip_tau is not None and not (self.qk_clip_tau >= 0 and math.isfinite(self.qk_clip_tau)):
            bad("qk_clip_tau", "must be a finite number >= 0 (0 disables QK-Clip)")
        for name in ("grad_clip", "save_every_minutes"):
            if not getattr(self, name) > 0:  # inf is allowed: no clipping, no periodic saves
                bad(name, "must be a positive number")
        if not 0 <= self.warmup_frac <= 1:
            bad("warmup_frac", "must be in [0, 1]")
        if not 0 <= self.min_lr_ratio <= 1:
            bad("min_lr_ratio", "must be in [0, 1]")
        for name in ("eval_every", "eval_batches", "log_every", "max_bad_steps"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                bad(name, "must be an integer >= 1")
        if self.balance not in ("histogram", "exact", "sign", "none"):
            bad("balance", "must be histogram, exact, sign or none")
        if self.micro_batch_rows is not None and self.micro_batch_rows < 1:
            bad("micro_batch_rows", "must be >= 1")
        if not isinstance(self.balance_diagnostics, bool):
            bad("balance_diagnostics", "must be True or False")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
        if not isinstance(self.activation_checkpointing, bool):
            bad("activation_checkpointing", "must be True or False")
        if self.qat not in (None, "mxfp4"):
            bad("qat", "must be mxfp4 or none")
        if not isinstance(self.save_checkpoints, bool):
            bad("save_checkpoints", "must be True or False")
        if self.qat is not None and not self.save_checkpoints:
            bad("save_checkpoints", "a QAT run exports its final checkpoint: it cannot run without checkpoints")
        if not (isinstance(self.keep_checkpoints, int) and self.keep_checkpoints >= 1):
            bad("keep_checkpoints", "must be an integer >= 1")
        if self.context_schedule is not None:
            try:
                check_context_schedule(self.context_schedule, self.batch_tokens)
            except ValueError as e:
                bad("context_schedule", str(e))
            if self.seq_len != self.context_schedule[0][0]:
                bad("seq_len", f"with a context schedule it is the schedule's first length, "
                               f"{self.context_schedule[0][0]}")
        if self.activation_checkpointing_from is not None and not (
                isinstance(self.activation_checkpointing_from, int) and self.activation_checkpointing_from >= 1):
            bad("activation_checkpointing_from", "must be a whole number of tokens >= 1")
        if not (isinstance(self.long_doc_share, (int, float)) and 0 <= self.long_doc_share <= 1):
            bad("long_doc_share", "must be a number in [0, 1]")

    @property
    def rows_per_step(self) -> int:
        return max(1, self.batch_tokens // self.seq_len)
