"""Progressive context extension (report §3.4): `k3 train --context-schedule 8192:0.7,65536:0.2,262144:0.1` trains
the first 70% of the run on rows of 8,192 tokens, the next 20% on 65,536 and the last 10% on 262,144.

* Shares are of the run's budget: of its steps when --max-steps or --epochs sets one (--epochs: the steps that
  read the training data that many times, counted in tokens; the smaller budget when both are given), otherwise of
  its training time (--max-minutes; the stage changes at the first step after the time share is spent). Stage k
  covers the steps after round(S_k B) up to round(S_{k+1} B), S_k the sum of the shares before it and B the
  budget; a stage that rounds to no step is skipped. The stage never goes back (a resume with a larger budget
  finishes the stage it is in first). The learning-rate schedule spans the whole run, not each stage.
* Tokens per optimizer step stay --batch-tokens: a stage of length L reads --batch-tokens / L rows a step, so every
  length must divide --batch-tokens. Lengths rise, each a multiple of the KDA chunk (64 tokens, the fast kernels'
  tile; under --cp P, of 64 P, so every rank's segment is whole chunks); --seq-len is the first length.
* Each stage reads its own stream of rows: the training tokens cut into rows of its length, in a fresh shuffled
  order (k3.data.packing.PackedLoader, seeded by --seed), from its start. The later stages of a run on the default
  corpus also read long documents (k3.data.long_docs: each standard-library package in import order): a share
  (--long-doc-share, default one half) of each step's rows are rows of the package documents, the rest rows of the
  corpus (`MixedLoader`: which rows, by a running count, so the share holds over any run of steps). A run on --data
  reads its own data at every length.
* Activation checkpointing is on in a stage when --activation-checkpointing is (every stage), when its length is
  at least --activation-checkpointing-from, or, without that flag, when one forward of it holds more tokens than one
  of the first stage (its rows per forward, --micro-batch-rows or the whole batch, times its length): activation
  memory grows with a forward's tokens.
* Held-out evaluation stays at the first length (--seq-len), so val_loss compares across stages.
* metrics.jsonl records `stage` and `seq_len` with each step; a checkpoint's loader state records the stage, its
  length and the position in its stream, and --resume continues there.
"""

from __future__ import annotations

import math

import torch

from k3.ops.kda_backend import FLA_CHUNK

SEQ_MULTIPLE = FLA_CHUNK  # every length is whole KDA chunks
DEFAULT_LONG_DOC_SHARE = 0.5


def parse_context_schedule(text: str) -> list[list]:
    """`LEN:SHARE,LEN:SHARE,...` -> [[LEN, SHARE], ...] (lists: the form a checkpoint's JSON keeps). ValueError
    names the item that is wrong. The shares must sum to 1 and the lengths rise (`check_context_schedule` checks
    the rest against the run's settings)."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise ValueError(f"context schedule {text!r}: expected LEN:SHARE items separated by commas, "
                         "e.g. 8192:0.7,65536:0.2,262144:0.1")
    stages = []
    for item in items:
        length, sep, share = item.partition(":")
        try:
            if not sep:
                raise ValueError
            stage = [int(length), float(share)]
        except ValueError:
            raise ValueError(f"context schedule item {item!r}: expected LEN:SHARE, a whole number of tokens and "
                             "a share of the run, e.g. 8192:0.7") from None
        stages.append(stage)
    check_shape(stages)
    return stages


def check_shape(stages) -> None:
    """The schedule on its own: [[LEN, SHARE], ...], lengths >= 8 and rising, shares in (0, 1] summing to 1."""
    if not isinstance(stages, (list, tuple)) or not stages or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 for s in stages):
        raise ValueError(f"context schedule {stages!r}: expected a list of [length, share] pairs")
    for length, share in stages:
        if isinstance(length, bool) or not isinstance(length, int) or length < 8:
            raise ValueError(f"context schedule length {length!r}: must be a whole number of tokens >= 8")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0 < share <= 1):
            raise ValueError(f"context schedule share {share!r} (length {length}): must be a number in (0, 1]")
    lengths = [s[0] for s in stages]
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"context schedule lengths {lengths}: must rise from stage to stage")
    total = math.fsum(s[1] for s in stages)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"context schedule shares {[s[1] for s in stages]} sum to {total:g}: they must sum to 1 "
                         "(each is a share of the run's steps, or of its time with --max-minutes alone)")


def check_context_schedule(stages, batch_tokens: int, cp: int = 1, data_ranks: int = 1) -> None:
    """The schedule against the run: every length a multiple of 64 x cp, dividing --batch-tokens (so a step holds
    --batch-tokens tokens at every length), and under data parallelism leaving rows that divide among the data
    ranks. ValueError says which length fails and what would do."""
    check_shape(stages)
    multiple = SEQ_MULTIPLE * cp
    for length, _ in stages:
        if length % multiple:
            why = f"64 x --cp {cp}, each context-parallel rank's segment whole KDA chunks" if cp > 1 else \
                "the KDA chunk, 64 tokens"
            raise ValueError(f"context schedule length {length}: must be a multiple of {multiple} ({why})")
        if batch_tokens % length:
            lcm = math.lcm(*(s[0] for s in stages)) * data_ranks
            lcm *= -(-batch_tokens // lcm)  # the nearest that does, not below --batch-tokens
            raise ValueError(f"context schedule length {length} does not divide --batch-tokens {batch_tokens}: every "
                             f"stage keeps the tokens of a step, so each length must divide them (e.g. --batch-tokens "
                             f"{lcm})")
        rows = batch_tokens // length
        if rows % data_ranks:
            raise ValueError(f"context schedule length {length}: a step's {rows} rows (--batch-tokens {batch_tokens} "
                             f"/ {length}) do not divide among the {data_ranks} data ranks; raise --batch-tokens to "
                             f"a multiple of {length * data_ranks}")


def stage_starts(stages, budget_steps: int) -> list[int]:
    """The step after which each stage begins: round(S_k budget), S_k the sum of the shares before stage k."""
    out, cum = [], []
    for _, share in stages:
        out.append(round(math.fsum(cum) * budget_steps))
        cum.append(share)
    return out


def stage_at_step(stages, step: int, budget_steps: int) -> int:
    """The stage that trains the step after `step` (steps done), by steps."""
    starts = stage_starts(stages, budget_steps)
    return max(k for k, s in enumerate(starts) if s <= step)


def stage_at_progress(stages, progress: float) -> int:
    """The stage at `progress` in [0, 1] of the run's time: the last one whose share of time has begun."""
    cum, k = 0.0, 0
    for i, (_, share) in enumerate(stages):
        if progress >= cum - 1e-12:
            k = i
        cum = math.fsum([cum, share])
    return k


def checkpointing_for(stages, k: int, batch_tokens: int, micro_batch_rows: int | None, always: bool,
                      from_len: int | None) -> bool:
    """Whether stage `k` runs with activation checkpointing (the rule in the module docstring)."""
    if always:
        return True
    length = stages[k][0]
    if from_len is not None:
        return length >= from_len

    def forward_tokens(n: int) -> int:
        rows = batch_tokens // stages[n][0]
        return min(micro_batch_rows or rows, rows) * stages[n][0]

    return forward_tokens(k) > forward_tokens(0)


# ------------------------------------------------------------------------------------------- the loaders


def _take(loader, rows: int) -> dict[str, torch.Tensor] | None:
    """The next `rows` rows of a PackedLoader (None for none)."""
    if rows == 0:
        return None
    loader.batch_size = rows
    return loader.next_batch()


class MixedLoader:
    """Each step's rows from two loaders of one length: `share` of them from `long` (rows of long documents), the
    rest from `base`, the long rows first. Which rows are long follows a running count (the n-th row served is long
    when floor((n + 1) share) > floor(n share)), so the share holds over any run of steps, even of one row each.
    Resumable: the count and both loaders' states."""

    def __init__(self, base, long, share: float, rows: int):
        if base.seq_len != long.seq_len:
            raise ValueError(f"mixed loaders of lengths {base.seq_len} and {long.seq_len}")
        if not 0 <= share <= 1:
            raise ValueError(f"long-document share must be in [0, 1], got {share}")
        self.base, self.long, self.share, self.rows = base, long, float(share), rows
        self.seq_len = base.seq_len
        self.served = 0  # rows served so far

    def _long_rows(self) -> int:
        n, s = self.served, self.share
        return math.floor((n + self.rows) * s + 1e-9) - math.floor(n * s + 1e-9)

    def next_batch(self) -> dict[str, torch.Tensor]:
        k = self._long_rows()
        parts = [b for b in (_take(self.long, k), _take(self.base, self.rows - k)) if b is not None]
        self.served += self.rows
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    def state_dict(self) -> dict:
        return {"served": self.served, "base": self.base.state_dict(), "long": self.long.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.served = int(d["served"])
        self.base.load_state_dict(d["base"])
        self.long.load_state_dict(d["long"])


class StagedLoader:
    """The training batches of a context schedule: stage k's batches come from `make(k)` (a PackedLoader or a
    MixedLoader of the stage's length and --batch-tokens / length rows), built when the stage is entered, from its
    stream's start. `num_rows` and `tokens_per_epoch` are the first stage's (the training data's), which the
    trainer's budget in epochs and its plan count in. Its state is the stage, its length and its loader's state."""

    def __init__(self, stages, make, first):
        self.stages = [list(s) for s in stages]
        self._make = make
        self.stage = 0
        self.current = first  # stage 0's loader (built by the run: its errors come before any training)
        self.num_rows = first.num_rows
        self.tokens_per_epoch = first.tokens_per_epoch
        self.data = getattr(first, "data", None)

    @property
    def seq_len(self) -> int:
        return self.stages[self.stage][0]

    def enter(self, k: int) -> None:
        """Move to stage `k` (> the current one), its stream read from the start."""
        if k < self.stage:
            raise ValueError(f"context stage {k} is before the current stage {self.stage}")
        if k != self.stage:
            self.current = self._make(k)
            self.stage = k

    def next_batch(self) -> dict[str, torch.Tensor]:
        return self.current.next_batch()

    def state_dict(self) -> dict:
        return {"stage": self.stage, "seq_len": self.seq_len, "stage_loader": self.current.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if "stage" not in d:
            raise ValueError("the loader state holds no context stage: the run was saved without --context-schedule "
                             "and cannot continue with one")
        k = int(d["stage"])
        if not 0 <= k < len(self.stages) or int(d["seq_len"]) != self.stages[k][0]:
            raise ValueError(f"the checkpoint is in context stage {k} at length {d['seq_len']}, which the schedule "
                             f"{self.stages} does not have")
        self.current = self._make(k) if k != self.stage else self.current
        self.stage = k
        self.current.load_state_dict(d["stage_loader"])

