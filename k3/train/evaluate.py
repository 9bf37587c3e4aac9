"""Held-out evaluation: the token-weighted mean next-token loss over fixed windows of a token stream (`k3 eval`,
and the trainer before the first step and every --eval-every steps), or over fixed labelled batches (SFT rows)."""

from __future__ import annotations

import numpy as np
import torch

from k3.data.packing import eval_batches
from k3.model.batch import BatchInfo


def eval_extent(n_tokens: int, seq_len: int, rows: int, max_batches: int | None) -> tuple[int, int]:
    """(batches, tokens) an evaluation of a stream of `n_tokens` reads in windows of `seq_len`, `rows` per batch,
    stopping after `max_batches` (as k3.data.packing.eval_batches cuts it)."""
    windows = -(-n_tokens // seq_len)
    batches = -(-windows // rows)
    if max_batches is not None:
        batches = min(batches, max_batches)
    return batches, min(n_tokens, batches * rows * seq_len)


def evaluate_loss(model, stream: np.ndarray, seq_len: int, eos_id: int, max_batches: int | None, rows: int,
                  device, autocast_bf16: bool = False) -> float:
    """Mean next-token loss over held-out windows (token-weighted)."""
    return evaluate_batches(model, eval_batches(stream, seq_len, rows, eos_id, max_batches=max_batches), device,
                            autocast_bf16)


@torch.no_grad()
def evaluate_batches(model, batches, device, autocast_bf16: bool = False) -> float:
    """Mean next-token loss over the labelled tokens (label != -100) of `batches` (dicts of input_ids, labels and
    segment_ids), token-weighted: the held-out loss of a stream's windows, or of packed SFT rows, whose labels
    are the assistant's tokens only."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        b = {k: v.to(device) for k, v in batch.items() if k != "segment_ids"}
        info = BatchInfo.from_segment_ids(batch["segment_ids"]).to(device)  # offsets from the host copy
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast_bf16):
            out = model(b["input_ids"], labels=b["labels"], batch=info, return_logits=False)
        n = int((b["labels"][:, 1:] != -100).sum())
        if n:
            total += float(out.loss) * n
            count += n
    if count == 0:
        raise ValueError("the held-out data has no complete window: use a shorter --seq-len or more data")
    return total / count
