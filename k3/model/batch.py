"""The per-batch record: where the packed documents of a batch start and end, and which positions need logits.

Built once where a batch is made (the trainer and the evaluation loop from the packed rows, the serving runner
from the requests it packs into one row) and passed to every layer, as nano-vllm's ``Context`` but passed rather
than global. The layers read what they need from it: Gated MLA the segment ids (its document mask, and the flex
block mask built once per record), KDA the document offsets (its varlen kernels, and on the host fla's chunk
lists without a device read). Its inputs are checked once, here, without reading anything back from the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from k3.tensors import to_device_async

__all__ = ["BatchInfo", "ContextParallel", "packed_cu_seqlens"]


def packed_cu_seqlens(segment_ids: Tensor) -> Tensor:
    """Offsets of the documents of a [B, T] batch flattened to one row: a document starts at every row
    start and wherever the segment id changes."""
    B, T = segment_ids.shape
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    idx = torch.nonzero(start.reshape(-1)).squeeze(1)
    return torch.cat([idx, idx.new_tensor([B * T])])


def _integer(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} dtype {x.dtype} on {x.device}"
    return f"a {type(x).__name__}"


class ContextParallel(Protocol):
    """What a forward over one rank's segment of a packed row needs from context parallelism (report §5.1.2): the
    layers call these in place of their single-device ops when the batch record carries one (`BatchInfo.context`).
    The record's segment ids and offsets are then the segment's own (offsets local, ids global); labels are aligned
    with the positions (the target of position t at t), since the next token of a segment's last position lives on
    the next rank. Implemented by k3.parallel.context_parallel.ContextParallelRecord; the model imports no parallel
    code."""

    lengths: tuple[int, ...]  # every segment's length in rank order (they sum to the row's)

    def kda(self, q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, A_log: Tensor, dt_bias: Tensor,
            lower_bound: float, cu_seqlens: Tensor, backends=None) -> Tensor:
        """k3.ops.kda_backend.kda's math (raw logits, [1, T_i, ...]) for this segment, its incoming state from the
        earlier segments: the output o [1, T_i, H, V]. `backends`: the layer's (which implementations run)."""
        ...

    def conv_halo(self, x: Tensor, width: int, cu_seqlens: Tensor) -> Tensor:
        """The short conv's carried inputs [N_i, C, width - 1] for this segment's pre-conv rows x [1, T_i, C]."""
        ...

    def mla(self, q: Tensor, c: Tensor, k_rope: Tensor, kv_up: Callable[[Tensor], Tensor], scale: float,
            segment_ids: Tensor, return_max_logit: bool = False):
        """Gated MLA's attention core for this segment's queries over the keys of this and every earlier
        segment: o [1, T_i, H, Dv]; with `return_max_logit`, (o, this segment's per-head max logit [H] fp32)."""
        ...

    def rows_after(self, x: Tensor, n: int) -> Tensor:
        """The first min(n, rows after this segment) rows [1, h, ...] of the row after this segment, from the later
        segments' integer per-token values x [1, T_i, ...] (token ids, document ids, labels; no gradient)."""
        ...

    def shifted(self, d: int) -> "ContextParallel":
        """The record of the MTP block at depth d, whose position t holds token t + d: the same group, every
        segment cut where the backbone's is, the last one d positions shorter."""
        ...

    def token_count(self, n: Tensor) -> Tensor:
        """The whole row's count from this segment's count `n` (summed over the group; no gradient)."""
        ...


class _Memo:
    """BatchInfo's per-batch values (see BatchInfo._memo)."""

    __slots__ = ("values",)

    def __init__(self):
        self.values: dict = {}


@dataclass(frozen=True, eq=False)
class BatchInfo:
    """What the layers need to know about one batch besides its tokens.

    segment_ids: [B, T] integer document id of every position; None: every row is one document. Gated MLA lets a
        query see only keys of its own id.
    cu_seqlens: [N + 1] int64 offsets of the N documents of the batch flattened to one row (a document starts at
        every row start and wherever the id changes), on the segment ids' device; KDA and its short conv run the
        documents as separate sequences. None with segment ids only for a stack without KDA layers (the MTP block).
    cu_seqlens_cpu: the same offsets on the host, or None. With them fla's chunk kernels build their chunk lists
        on the host, so a forward never waits for the device.
    logit_positions: [n] integer positions along the token axis whose logits are wanted (the same for every row;
        the serving runner asks for each packed request's last token), or None for every position.
    context: under context parallelism, the segment's ContextParallel (its layers' collective forms), with the
        other fields describing this rank's segment of one packed row; None otherwise.

    Build it with :meth:`from_segment_ids` or :meth:`from_lengths` (the constructor takes the fields as they are,
    checked but not derived from one another); :meth:`to` moves it to the model's device."""

    segment_ids: Tensor | None = None
    cu_seqlens: Tensor | None = None
    cu_seqlens_cpu: Tensor | None = None
    logit_positions: Tensor | None = None
    context: ContextParallel | None = None
    # Per-batch values built on first use and reused by every layer (and by the recompute of activation
    # checkpointing): the flex block mask. An opaque holder, not a dict: FSDP2's input cast rebuilds every
    # dataclass argument field by field (dataclasses.replace) and copies dicts, and the holder passes through
    # both as the same object, so every copy of the record shares one memo.
    _memo: "_Memo" = field(default_factory=lambda: _Memo(), repr=False, compare=False)

    def __post_init__(self):
        seg, cu, cu_cpu = self.segment_ids, self.cu_seqlens, self.cu_seqlens_cpu
        if seg is not None and (not isinstance(seg, Tensor) or seg.ndim != 2 or not _integer(seg)):
            raise ValueError(f"segment_ids must be an integer [batch, tokens] tensor, got {_describe(seg)}")
        if cu is not None:
            if seg is None:
                raise ValueError("cu_seqlens needs the segment_ids it was computed from")
            if not isinstance(cu, Tensor) or cu.ndim != 1 or cu.numel() < 2 or not _integer(cu):
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor of document offsets [0, ..., B*T], got "
                                 f"{_describe(cu)}")
            if cu.device != seg.device:
                raise ValueError(f"cu_seqlens must be on the segment_ids' device {seg.device}, got {cu.device}")
        if cu_cpu is not None:
            if seg is None:
                raise ValueError("cu_seqlens_cpu needs the segment_ids it was computed from")
            if not isinstance(cu_cpu, Tensor) or cu_cpu.device.type != "cpu" or cu_cpu.ndim != 1 \
                    or cu_cpu.numel() < 2 or not _integer(cu_cpu):
                raise ValueError("cu_seqlens_cpu must be a 1-D host tensor of document offsets [0, ..., B*T], "
                                 f"got {_describe(cu_cpu)}")
            n = seg.numel()
            if int(cu_cpu[0]) != 0 or int(cu_cpu[-1]) != n or not bool((cu_cpu[1:] > cu_cpu[:-1]).all()):
                shown = cu_cpu.tolist()[:8] + (["..."] if cu_cpu.numel() > 8 else [])
                raise ValueError(f"cu_seqlens_cpu must rise strictly from 0 to B*T = {n} (one entry per document "
                                 f"start, then the end), got {shown}")
            if cu is None:
                raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens: give both, or build the record "
                                 "with BatchInfo.from_segment_ids(segment_ids, cu_seqlens_cpu=...)")
            if cu.numel() != cu_cpu.numel():
                raise ValueError(f"cu_seqlens ({cu.numel()} entries) and cu_seqlens_cpu ({cu_cpu.numel()} entries) "
                                 "must be the same offsets")
        if self.context is not None and (seg is None or seg.shape[0] != 1):
            raise ValueError("a context-parallel record describes one rank's segment of one packed row: give its "
                             "segment ids [1, T_i], and their offsets for KDA layers "
                             "(BatchInfo.from_segment_ids(..., context=...))")
        pos = self.logit_positions
        if pos is not None and (not isinstance(pos, Tensor) or pos.ndim != 1 or not _integer(pos)):
            raise ValueError(f"logit_positions must be a 1-D integer tensor of token positions, got {_describe(pos)}")

    # --- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_segment_ids(cls, segment_ids: Tensor, cu_seqlens_cpu: Tensor | None = None,
                         logit_positions: Tensor | None = None,
                         context: ContextParallel | None = None) -> "BatchInfo":
        """The record of a [B, T] batch of packed documents. The offsets are computed where `segment_ids` lie:
        on the host for a host tensor (then `.to(device)` moves the record without any device read: the trainer's
        way), on the device otherwise (which reads their count back). `cu_seqlens_cpu`, when the caller has
        `packed_cu_seqlens(segment_ids)` on the host already, is used instead and copied to the device."""
        if not isinstance(segment_ids, Tensor) or segment_ids.ndim != 2 or not _integer(segment_ids):
            raise ValueError(f"segment_ids must be an integer [batch, tokens] tensor, got {_describe(segment_ids)}")
        if cu_seqlens_cpu is None:
            cu = packed_cu_seqlens(segment_ids)
            cu_cpu = cu if cu.device.type == "cpu" else None
        else:
            if not isinstance(cu_seqlens_cpu, Tensor) or cu_seqlens_cpu.device.type != "cpu" \
                    or cu_seqlens_cpu.ndim != 1:
                raise ValueError("cu_seqlens_cpu must be a 1-D host tensor of document offsets [0, ..., B*T], "
                                 f"got {_describe(cu_seqlens_cpu)}")
            cu_cpu = cu_seqlens_cpu.to(torch.int64)
            cu = to_device_async(cu_cpu, segment_ids.device)
        return cls(segment_ids=segment_ids, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, logit_positions=logit_positions,
                   context=context)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | Sequence[Sequence[int]], device=None,
                     logits_at_ends: bool = False) -> "BatchInfo":
        """The record of documents of the given lengths packed one after another: one row for a list of ints,
        one row per list for a list of lists (rows of equal total length). Built on the host, then moved to
        `device` without any device read. `logits_at_ends`: logits only at each document's last token (one row;
        the serving runner packs requests this way and samples from their last tokens)."""
        rows = [lengths] if not lengths or not isinstance(lengths[0], Sequence) else list(lengths)
        if not rows or not all(rows):
            raise ValueError(f"lengths must hold at least one document per row, got {lengths!r}")
        for r in rows:
            bad = [n for n in r if isinstance(n, bool) or not isinstance(n, int) or n < 1]
            if bad:
                raise ValueError(f"document lengths must be positive ints, got {bad[0]!r} in {list(r)!r}")
        totals = {sum(r) for r in rows}
        if len(totals) != 1:
            raise ValueError(f"every row must hold the same number of tokens, got row totals {[sum(r) for r in rows]}")
        if logits_at_ends and len(rows) != 1:
            raise ValueError(f"logits_at_ends needs one row of documents, got {len(rows)} rows")
        seg = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
        cu = torch.tensor([0] + [n for r in rows for n in r]).cumsum(0)
        ends = cu[1:] - 1 if logits_at_ends else None
        info = cls(segment_ids=seg, cu_seqlens=cu, cu_seqlens_cpu=cu, logit_positions=ends)
        return info if device is None else info.to(device)

    def to(self, device) -> "BatchInfo":
        """The record with its tensors on `device` (host to CUDA through pinned memory, without waiting); the host
        copy of the offsets stays on the host."""
        device = torch.device(device)

        def move(t):
            return t if t is None or t.device == device else to_device_async(t, device)

        cu_cpu = self.cu_seqlens_cpu
        if cu_cpu is None and self.cu_seqlens is not None and self.cu_seqlens.device.type == "cpu":
            cu_cpu = self.cu_seqlens
        return replace(self, segment_ids=move(self.segment_ids), cu_seqlens=move(self.cu_seqlens),
                       cu_seqlens_cpu=cu_cpu, logit_positions=move(self.logit_positions))

    def shifted(self, d: int) -> "BatchInfo":
        """The record of the batch without the first `d` positions of each row (the MTP layer at depth d sees
        tokens d:): its segment ids only, since the MTP block is Gated MLA and needs no offsets. Not for a
        context-parallel segment, whose MTP positions read the next segments' tokens (K3ForCausalLM's MTP loss
        builds that record)."""
        if self.context is not None:
            raise ValueError("BatchInfo.shifted drops a row's first positions; a context-parallel segment's MTP "
                             "record needs the next segments' tokens (ContextParallel.rows_after, .shifted)")
        if self.segment_ids is None:
            return BatchInfo()
        return BatchInfo(segment_ids=self.segment_ids[:, d:])

    # --- checks and per-batch values -------------------------------------------------------------------------
    def check(self, batch: int, tokens: int) -> None:
        """Raise a ValueError when the record does not describe a [batch, tokens] input."""
        seg = self.segment_ids
        if seg is not None and tuple(seg.shape) != (batch, tokens):
            raise ValueError(f"segment_ids must have the input's shape [batch={batch}, tokens={tokens}], got "
                             f"{tuple(seg.shape)}")
        cu = self.cu_seqlens_cpu
        if cu is not None and int(cu[-1]) != batch * tokens:
            raise ValueError(f"cu_seqlens_cpu must end at B*T = {batch * tokens}, got {int(cu[-1])}")

    def flex_block_mask(self, device: torch.device):
        """flex_attention's causal document block mask for this batch (`k3.ops.mla.causal_block_mask`), built on
        first use and kept for every Gated MLA layer of the forward and for their recompute in backward."""
        key = ("flex_block_mask", torch.device(device))
        memo = self._memo.values
        if key not in memo:
            from k3.ops.mla import causal_block_mask

            memo[key] = causal_block_mask(self.segment_ids.shape[1], device, self.segment_ids)
        return memo[key]
