"""How the model reads its decode caches: one small typed protocol per layer kind, and the contiguous caches.

A layer never inspects the cache object it is handed; it calls the protocol:

* a KDA layer (`KDALayerCache`) reads its recurrent state and conv tails with `read()` and stores the new ones
  with `update()`: the state is fixed-size, so every implementation is a place to keep two things;
* a Gated MLA layer (`MLALayerCache`) hands the cache its new latent rows and queries with
  `attend(attn, q, c, k_rope)`; the cache stores the rows wherever it keeps them and answers with the attention
  output, computed by one of the forms the layer offers (`LatentAttention`: the expanded prefill form, the
  absorbed form over a gathered latent cache, or the paged kernel that reads pages in place). Which form fits is
  the cache's knowledge (where its rows live), the math stays in the layer.

Two families implement the protocols: the contiguous caches below (`K3ForCausalLM.new_cache()`: one request,
growing tensors, for generation and tests) and the serving engine's paged views (k3/serve/cache/views.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class LatentAttention(Protocol):
    """What a Gated MLA layer offers the cache that answers its `attend`: q [B, T, H, dn + dr], c [., ., R] the
    normalized latent rows, k_rope [., ., dr]; each returns the attention output [B, T, H, dv]."""

    def expanded(self, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        """Prefill of rows with no cached context: keys and values expanded per head from the new latent rows."""

    def absorbed(self, q: Tensor, c_all: Tensor, kr_all: Tensor, q_start, kv_len=None, check: bool = True) -> Tensor:
        """Attention against a latent cache (c_all [B, L, R], kr_all [B, L, dr]) in the absorbed form: query t of
        row b sits at position q_start (+ b's offset) + t; `kv_len` the valid length of each row (None: all).
        `check=False` with tensor positions and lengths valid by construction: nothing is read back to check them."""

    def masked(self, q: Tensor, c_all: Tensor, kr_all: Tensor, mask: Tensor) -> Tensor:
        """Attention against latent rows (c_all [B, L, R], kr_all [B, L, dr]) with an explicit visibility mask
        [B, T, L]: for contexts that are not a causal prefix (the EAGLE-3 training-time test)."""

    def paged(self, q: Tensor, pages: Tensor, tables: Tensor, lengths: Tensor, num_splits: int | None,
              gate: Tensor | None = None) -> Tensor:
        """Attention straight from a page pool (k3.ops.mla_decode): every query row (B * T, request-major) reads
        the pages of its block table up to its length; `num_splits` fixed (a CUDA-graph step) or None. `gate`
        [B, T, H * dv]: the output gate applied too (as `gated`)."""

    def gated(self, gate: Tensor, o: Tensor) -> Tensor:
        """The output gate sigmoid(gate) * o of an attention output o [B, T, H, dv] (gate [B, T, H * dv])."""

    def paged_kernel_used(self) -> bool:
        """Whether `paged` runs on the paged kernel (else on the reference, which reads lengths back)."""


@dataclass
class KDAInputs:
    """A KDA layer's projected inputs of one forward's tokens, as the layer hands them to its cache: enough to
    replay any prefix of them through the recurrence from the state the forward started from (speculative
    verification keeps them instead of the advanced state, report §5.4.2).

    pre_conv: the q, k, v projections before the short conv, each [B, T, P]; q, k, v: after the conv and SiLU
    [B, T, H, K] (q, k not yet L2-normalized); z: decay logits before dt_bias [B, T, H, K]; beta_logits [B, T, H]."""

    pre_conv: tuple[Tensor, Tensor, Tensor]
    q: Tensor
    k: Tensor
    v: Tensor
    z: Tensor
    beta_logits: Tensor


class KDALayerCache(Protocol):
    def read(self) -> tuple[Tensor | None, list[Tensor | None]]:
        """(state [B, H, K, V] fp32 or None, the q/k/v conv tails [B, P, W-1] or None each)."""

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        """Keep the state and conv tails after this forward's tokens. `inputs`: the forward's projected inputs;
        a cache that must not advance (the serving engine's speculative verification) keeps them instead."""

    # Optional: `decode_store() -> k3.ops.kda_decode.KDAStore | None`. A cache that keeps its states as rows of one
    # fp32 tensor (the serving pool's pages) offers them there; the layer then runs a single-token step as one fused
    # update in place (k3.ops.kda_decode) instead of read, the ops and update. None, or no such method: read/update.
    #
    # Optional: `pending_replay() -> (KDAInputs, lengths, KDAStore) | None` and `replayed(inputs)`. A verification
    # cache whose committed states still lack positions accepted earlier (the serving engine's fused replay) hands
    # them over with the rows its states live in: the layer runs `KimiDeltaAttention.verify_replay` (the pending
    # positions, then the window, in one pass; the rows advanced in place to the state and conv tail after the
    # pending positions) and returns the window's inputs through `replayed`, instead of read/update.


class MLALayerCache(Protocol):
    def attend(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        """Store the new latent rows (c [B, T, R], k_rope [B, T, dr]) and return the attention of q [B, T, H, ·]
        over everything cached up to each query's position [B, T, H, dv]."""

    def token_positions(self, c: Tensor) -> Tensor:
        """The positions [B, T] the new rows c [B, T, R] will take (in a packed row, each request's own): what the
        RoPE ablation rotates by, before `attend` stores the rows. K3 (NoPE) never asks."""

    # Optional: `attend_gated(attn, q, c, k_rope, gate) -> Tensor`, `attend` with Gated MLA's output gate (gate
    # [B, T, H * dv]) applied to its result: sigmoid(gate) * o, [B, T, H, dv]. A cache whose attention ends in the
    # paged decode's value absorption (the serving engine's) offers it, so that the gate runs inside that kernel
    # (op mla_combine_absorb_v_gate); the layer gates `attend`'s result itself where a cache has no such method.


class KDACache:
    """One KDA layer's contiguous decode state: the fp32 recurrent state and the q/k/v short-conv tails."""

    def __init__(self) -> None:
        self.state: Tensor | None = None  # [B, H, K, V] fp32
        self.conv: list[Tensor | None] = [None, None, None]  # q, k, v tails [B, P, W-1]

    def read(self) -> tuple[Tensor | None, list[Tensor | None]]:
        return self.state, self.conv

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        self.state, self.conv = state, list(conv)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.state, *self.conv] if t is not None)


class MLACache:
    """One MLA layer's contiguous decode cache: the normalized latent c and the shared extra key dims, per token,
    of a batch of rows that all hold the same number of tokens.

    The rows live in backing tensors with room to grow (a quarter more than needed, at least 16 rows), so that an
    append writes only its new rows (a decode step's one row, not a copy of the whole cache); `c` and `k_rope` are
    views of the held rows. Rows seen by a `fork` are never written again: an append that would write over them
    (after a truncation below them) moves the rows to new backing tensors first."""

    def __init__(self, prefill_form: bool = True) -> None:
        # the first forward into an empty cache in the prefill form (keys and values expanded: the mla op, on a GPU a
        # flex_attention kernel compiled per length), else the absorbed form always (plain ops: no compilation per
        # length, what a serving draft's contexts of every length need)
        self.prefill_form = prefill_form
        self.c: Tensor | None = None  # [B, L, kv_lora_rank]: a view of _cbuf[:, _off:_off + L]
        self.k_rope: Tensor | None = None  # [B, L, qk_rope_head_dim]
        self.start = 0  # position of the first kept row (rows dropped by keep_last)
        self._cbuf: Tensor | None = None
        self._kbuf: Tensor | None = None
        self._off = 0  # where the held rows start in the backing tensors
        self._protected = 0  # held rows (from _off) that a fork may view: never written again
        self._owner = False  # whether appends may write into the backing tensors (a fork's views may not)

    @property
    def length(self) -> int:
        return 0 if self.c is None else self.c.shape[1]

    def attend(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        past = self.length
        self.append(c, k_rope)
        if not past and self.prefill_form:
            return attn.expanded(q, c, k_rope)  # nothing cached before: the prefill form
        return attn.absorbed(q, self.c, self.k_rope, q_start=past)

    def token_positions(self, c: Tensor) -> Tensor:
        B, T = c.shape[:2]
        return (self.start + self.length + torch.arange(T, device=c.device)).expand(B, T)

    def append(self, c: Tensor, k_rope: Tensor) -> None:
        """Keep rows c [B, T, kv_lora_rank] and k_rope [B, T, qk_rope_head_dim] after the cached ones (copied: the
        cache never holds the caller's tensors)."""
        L, T = self.length, c.shape[1]
        room = self._room(c, k_rope)
        if room is not None:
            room[0].copy_(c)
            room[1].copy_(k_rope)
        else:  # new backing tensors, the held rows and the new ones copied in
            need = L + T
            cap = need + max(need // 4, 16)
            cbuf = c.new_empty((c.shape[0], cap, c.shape[2]))
            kbuf = k_rope.new_empty((k_rope.shape[0], cap, k_rope.shape[2]))
            if L:
                cbuf[:, :L].copy_(self.c)
                kbuf[:, :L].copy_(self.k_rope)
            cbuf[:, L:need].copy_(c)
            kbuf[:, L:need].copy_(k_rope)
            self._cbuf, self._kbuf, self._off, self._protected, self._owner = cbuf, kbuf, 0, 0, True
        self._view(L + T)

    @staticmethod
    def append_each(caches: list["MLACache"], rows: list[tuple[Tensor, Tensor]]) -> None:
        """`caches[i].append(*rows[i])` for each i (distinct caches): the appends that fit their backing tensors as
        one multi-tensor copy (a launch or two on a GPU, where appending one by one takes two per cache: a draft's
        contexts after each proposal), the others as `append`."""
        dst, src = [], []
        for cc, (c, k_rope) in zip(caches, rows, strict=True):
            room = cc._room(c, k_rope)
            if room is None:
                cc.append(c, k_rope)
                continue
            dst += room
            src += [c, k_rope]
            cc._view(cc.length + c.shape[1])
        if dst:
            torch._foreach_copy_(dst, src)

    def _room(self, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor] | None:
        """Where rows c / k_rope go when they fit after the held ones in backing tensors this cache may write
        (views of them), else None (`append` moves the rows to new ones)."""
        L, T = self.length, c.shape[1]
        if not (self._owner and self._fits(c, k_rope, L + T) and L >= self._protected):
            return None
        end = self._off + L
        return self._cbuf[:, end:end + T], self._kbuf[:, end:end + T]

    def _fits(self, c: Tensor, k_rope: Tensor, length: int) -> bool:
        b, kb = self._cbuf, self._kbuf
        return (b is not None and self._off + length <= b.shape[1] and b.shape[0] == c.shape[0]
                and b.shape[2] == c.shape[2] and kb.shape[2] == k_rope.shape[2] and b.dtype == c.dtype
                and kb.dtype == k_rope.dtype and b.device == c.device)

    def _view(self, length: int) -> None:
        self.c = self._cbuf[:, self._off:self._off + length]
        self.k_rope = self._kbuf[:, self._off:self._off + length]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (drop rows written past them, e.g. a draft's own guesses)."""
        if self.c is not None and length < self.length:
            self._view(max(length, 0))

    def keep_last(self, length: int) -> None:
        """Keep the last `length` tokens (a bounded window; the kept rows mean what they meant: K3's layer has no
        positional encoding, and the RoPE ablation's later rows still take positions after the dropped ones)."""
        if self.c is not None and self.c.shape[1] > length:
            drop = self.c.shape[1] - length
            self.start += drop
            self._off += drop
            self._protected = max(self._protected - drop, 0)
            self._view(length)

    def fork(self) -> "MLACache":
        """A cache holding the same rows that can be advanced without changing this one (nor this one it): it views
        this one's backing tensors without writing into them (its first append moves its rows to its own), and this
        one never writes over the rows held now."""
        n = MLACache(self.prefill_form)
        if self.c is not None:
            n.c, n.k_rope, n.start = self.c, self.k_rope, self.start
            n._cbuf, n._kbuf, n._off = self._cbuf, self._kbuf, self._off
            self._protected = max(self._protected, self.length)
        return n

    def nbytes(self) -> int:
        """Bytes of the held rows (the backing tensors' spare room not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.c, self.k_rope) if t is not None)


class K3Cache:
    """The decode cache of a whole model: per layer, a KDA or MLA layer cache (either family of the protocols).
    `packed`: the forward's new tokens are several requests' tokens one after another in a single row (segment
    ids tell them apart); only the serving engine's views support it."""

    def __init__(self, layer_caches: list[KDALayerCache | MLALayerCache], packed: bool = False):
        self.layers = layer_caches
        self.packed = packed
        self.seq_len = 0  # tokens processed so far

    def __getitem__(self, i: int):
        return self.layers[i]

    def nbytes(self) -> int:
        """Bytes held by a cache of the contiguous family."""
        return sum(c.nbytes() for c in self.layers)
