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
            logp, mask = target_logprobs(out.logits, mb), trained_mask(mb)
            ...                                   # per-token terms from logp, mask and mb.tensors[...]
            loss = terms.sum() / mb.step_tokens   # micro-batches (and ranks) sum to the step's token mean
            return LossOutput(loss, loss.detach().double(), out.stats, extra={"my_stat": ...})

`mb.tensors` holds every tensor of the step's batch but its document ids, sliced to the micro-batch's rows and on
the device: `input_ids`, `labels` (-100: not trained) and whatever per-token tensors the run's batch carries (MOPD:
the behaviour and teacher log-probs; an RL run: advantages, behaviour log-probs, staleness).

The convention of per-token tensors: a run's batch gives every per-token tensor ([rows, T, ...], T the rows'
tokens) aligned like the model's `labels` input, i.e. with `input_ids`: the value at t belongs to token t (its
label, its behaviour log-prob), which position t - 1 predicts. A loss receives them in one of two alignments,
`mb.aligned` telling which:
* a single process (and plain data parallelism): as the batch gives them; position 0 is never trained (nothing
  predicts the first token);
* context parallelism (`mb.aligned`, k3.train.distributed): the rank's segment of one packed row, each per-token
  tensor shifted one place left before the row was split, as `labels` are (k3.parallel.context_parallel.
  aligned_labels): the value at t belongs to token t + 1, the target of position t, which may live on the next
  rank; the row's last position holds -100 in `labels`, 0 elsewhere.
Either way `labels` and every per-token tensor stay aligned with each other, so a loss written elementwise over
them, with `target_logprobs` (the log-prob of each position's label, at the label's place) and `trained_mask`,
is right in both, and the segments' terms together are the row's.

A loss weighs its micro-batch so that the micro-batches' losses sum to the step's: by `mb.rows` (its share of the
step's rows) or by `mb.step_tokens` (the step's trained tokens; under data parallelism the global count divided
by the data ranks, so that FSDP2's average over the ranks of the ranks' token sums / step_tokens is the global
token mean, see MicroBatch). It must ask the forward for `mb.stats` and hand the output's `stats` back: balancing
and QK-Clip read them (a run with neither may hand back None: the EAGLE-3 draft's). Its `extra` statistics
(detached device tensors) come back per micro-batch to the run's `Trainer._finish_step`, which reads them once per
step; they are this process's (under context parallelism its segment's share); nothing travels through module
attributes.

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
    # the step's trained tokens (labels != -100 past position 0), fp32 on the device: a single process's own count;
    # under data parallelism the count over all data ranks / their number (DistributedTrainer._step_tokens)
    step_tokens: torch.Tensor

    @property
    def aligned(self) -> bool:
        """Whether `labels` and the per-token tensors are aligned with the positions (the target of t at t: a
        context-parallel segment) rather than with `input_ids` (see the module's docstring)."""
        return self.info.context is not None


@dataclass
class LossOutput:
    """What a loss returns for one micro-batch."""
    loss: torch.Tensor  # differentiated: the micro-batch's share of the step's objective
    value: torch.Tensor  # reported (detached, fp64): its share of the step's loss; the step's is their sum
    stats: ForwardStats | None  # the forward's statistics (those asked for in MicroBatch.stats)
    mtp: torch.Tensor | None = None  # reported (detached, fp64): its share of the step's MTP loss, if it has one
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss's own statistics (detached)


def trained_mask(mb: MicroBatch) -> torch.Tensor:
    """[rows, T] bool: the positions whose label is trained, in the micro-batch's alignment (position 0 of a row
    aligned with `input_ids` never is: nothing predicts it). Their count over the step is `step_tokens`."""
    mask = mb.tensors["labels"] != -100
    if not mb.aligned:
        mask[:, 0] = False
    return mask


def target_logprobs(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """log p(label) at the label's place, [rows, T], from the forward's logits [rows, T, V] of `mb`, 0 where no
    label is trained (`trained_mask`): aligned with `input_ids`, the label at t is predicted by position t - 1;
    aligned with the positions (`mb.aligned`), by position t. fp32 (fp64 logits stay fp64)."""
    labels, mask = mb.tensors["labels"], trained_mask(mb)
    x = logits if mb.aligned else logits[:, :-1]
    y = labels if mb.aligned else labels[:, 1:]
    lp = torch.log_softmax(x if x.dtype == torch.float64 else x.float(), -1)
    lp = lp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    if not mb.aligned:
        lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)
    return torch.where(mask, lp, torch.zeros_like(lp))


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
