"""The seam between the Trainer and what it trains for (torchtitan's `loss_fn`): a loss turns one micro-batch into
the tensor to differentiate, its share of the step's reported loss and its own statistics.

The Trainer (k3.train.trainer) writes everything around a loss once: the step's batch cut into micro-batches, the
copies to the device, the batch record (document offsets, a context-parallel segment), bf16 autocast, the weight
casts, backward (scaled by the context-parallel factor), the routing statistics for Quantile Balancing and the
maxima for QK-Clip, the OOM retry, the reduction over processes, metrics and checkpoints. A loss writes only what
one micro-batch computes:

    class MyLoss:
        def __call__(self, model, mb: MicroBatch) -> LossOutput:
            out = model(mb.tensors["input_ids"], batch=mb.info, check_ids=False, stats=mb.stats)
            ...                                   # per-token terms from out.logits and mb.tensors[...]
            loss = terms.sum() / mb.step_tokens   # micro-batches sum to the step's token mean
            return LossOutput(loss, loss.detach().double(), out.stats, extra={"my_stat": ...})

`mb.tensors` holds every tensor of the step's batch but its document ids, sliced to the micro-batch's rows and on
the device: `input_ids`, `labels` (-100: not trained) and whatever per-token tensors the run's batch carries (MOPD:
the behaviour and teacher log-probs; an RL run: advantages, behaviour and reference log-probs, token weights).
Under context parallelism (k3.train.distributed) a rank gets its segment's `input_ids` and position-aligned
`labels` only, which `NextTokenLoss` is written for: `DistributedTrainer` does not split other per-token tensors.
A loss weighs its micro-batch so that the micro-batches' losses sum to the step's: by `mb.rows` (its share of the
step's rows) or by `mb.step_tokens` (the step's trained tokens). It must ask the forward for `mb.stats` and hand
the output's `stats` back: balancing and QK-Clip read them (a run with neither may hand back None: the EAGLE-3
draft's). Its `extra` statistics (detached device tensors) come
back per micro-batch to the run's `Trainer._finish_step`, which reads them once per step; nothing travels through
module attributes.

`NextTokenLoss` is pre-training's and SFT's; MOPD's is k3.posttrain.distill.MOPDLoss, RL's k3.rl.loss.RLLoss, the
EAGLE-3 draft's k3.posttrain.eagle3.DraftLoss (its module the draft, the frozen target inside the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from k3.model.batch import BatchInfo
from k3.model.stats import ForwardStats


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as a loss sees it (built by `Trainer._accumulate`)."""
    tensors: dict[str, torch.Tensor]  # [rows, ...] each, on the device: input_ids, labels and the run's extras
    info: BatchInfo  # the batch record the forward takes (`model(..., batch=info)`)
    stats: tuple[str, ...]  # the statistics the forward must be asked for (routing, max_logit)
    rows: float  # its rows / the step's rows (of this process)
    step_tokens: torch.Tensor  # the step's trained tokens (labels != -100 past position 0), fp32 on the device


@dataclass
class LossOutput:
    """What a loss returns for one micro-batch."""
    loss: torch.Tensor  # differentiated: the micro-batch's share of the step's objective
    value: torch.Tensor  # reported (detached, fp64): its share of the step's loss; the step's is their sum
    stats: ForwardStats | None  # the forward's statistics (those asked for in MicroBatch.stats)
    mtp: torch.Tensor | None = None  # reported (detached, fp64): its share of the step's MTP loss, if it has one
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss's own statistics (detached)


class Loss(Protocol):
    def __call__(self, model, mb: MicroBatch) -> LossOutput: ...


@dataclass(frozen=True)
class NextTokenLoss:
    """Next-token cross-entropy over the labelled tokens, plus `mtp_weight` x the MTP layers' loss (pre-training,
    SFT). Each micro-batch's mean is weighted by its share of the step's rows, so micro-batches of equal token
    counts sum to the step's mean. The head's loss is computed in chunks without the [B, T, V] logits."""
    mtp_weight: float = 0.3

    def __call__(self, model, mb: MicroBatch) -> LossOutput:
        t = mb.tensors
        out = model(t["input_ids"], labels=t["labels"], batch=mb.info, return_logits=False, check_ids=False,
                    stats=mb.stats)
        loss = out.loss + (self.mtp_weight * out.mtp_loss if out.mtp_loss is not None else 0.0)
        mtp = out.mtp_loss.detach().double() * mb.rows if out.mtp_loss is not None else None
        return LossOutput(loss * mb.rows, out.loss.detach().double() * mb.rows, out.stats, mtp=mtp)
