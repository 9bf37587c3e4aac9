"""The views the model reads the page pool through: per-layer caches of one forward that implement the model's
cache protocol (k3.model.cache) over pool pages.

* `KDAPageView`: a KDA layer's states and conv tails of the forward's requests in their running-state pages. A
  single-token step updates them where they are (`decode_store`, k3.ops.kda_decode); a longer forward reads copies
  (`read`) and hands the new ones to `update`, which the runner writes back after the forward.
* `KDAVerifyView`: the same read for a speculative verification forward, which must not advance the committed
  state: it keeps the forward's projected inputs instead, for the replay of the accepted tokens (report §5.4.2).
* `KDAReplayVerifyView`: a verification with the replay of the request's pending accepted positions fused in front
  (EngineConfig.fused_replay, report §5.4.2): the pages holding the committed states, each row's pending inputs and
  their counts; the layer runs KimiDeltaAttention.verify_replay on it, which advances the pages in place to the
  state after the pending positions, and hands back the window's projected inputs (kept, as `KDAVerifyView` keeps
  them).
* `KDAMixedView`: a packed forward of prefill chunks and verifications together: the new states of every request
  (the runner writes back only the prefill requests') and the projected inputs of every position.
* `PagedMLAView`: an MLA layer's block tables for an eager forward. Rows of one length (a [B, T] batch) either
  attend straight from the pages (single-token steps on the paged kernel) or through a gathered copy of each
  request's context; a packed row (`lengths` given: the requests' tokens of different lengths one after another)
  attends each request's own context.
* `StaticMLAView`: an MLA layer's cache for a step over static buffers (a CUDA graph's inputs): block tables and
  positions are device tensors refilled before every replay and the paged kernel runs with a fixed split count,
  so the step reads nothing back from the device.

`layer_views` is the one place a forward's per-layer list of views is put together (eager forwards, verifications,
mixed forwards and the static-buffer steps all build theirs with it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.model.cache import KDAInputs, LatentAttention
from k3.ops.mla_append import mla_append_any
from k3.ops.registry import Backends
from k3.serve.cache.pool import CachePool


@dataclass
class SeqSlots:
    """Where one request's cache lives: a block table per MLA layer, a running-state page per KDA layer."""
    mla_tables: list[list[int]]
    kda_pages: list[int]


@dataclass(frozen=True)
class LayerLayout:
    """Which decoder layers are KDA and which MLA: the g-th KDA layer reads running-state page kda_pages[g], the
    g-th MLA layer block table mla_tables[g]."""
    num_layers: int
    kda: tuple[int, ...]
    mla: tuple[int, ...]

    @classmethod
    def of(cls, model) -> "LayerLayout":
        layers = model.model.layers
        return cls(len(layers), tuple(i for i, l in enumerate(layers) if l.is_kda),
                   tuple(i for i, l in enumerate(layers) if not l.is_kda))


def layer_views(layout: LayerLayout, pool: CachePool, kda_pages: Tensor, mla_views: list,
                kda_view=None, kda_given: list | None = None) -> tuple[list, list]:
    """(every layer's cache view, the KDA layers' views) of one forward: `kda_view` (a view class, built with its
    `over(pool, pages)`; default KDAPageView) over each KDA layer's states in its pages kda_pages[g] ([n_kda, B]
    device tensor), and mla_views[g] for the g-th MLA layer. `kda_given`: the KDA layers' views already built (one
    per KDA layer, in order), used instead of `kda_view`."""
    kda_view = KDAPageView if kda_view is None else kda_view
    if kda_given is not None and len(kda_given) != len(layout.kda):
        raise ValueError(f"{len(kda_given)} KDA views given for {len(layout.kda)} KDA layers")
    per_layer: list = [None] * layout.num_layers
    kda_views = []
    for g, li in enumerate(layout.kda):
        kda_views.append(kda_given[g] if kda_given is not None else kda_view.over(pool, kda_pages[g]))
        per_layer[li] = kda_views[-1]
    for g, li in enumerate(layout.mla):
        per_layer[li] = mla_views[g]
    return per_layer, kda_views


class KDAPageView:
    """One KDA layer's states [B, H, K, V] and conv tails [B, 3, P, W-1] of the forward's requests, in their pages.
    A single-token step advances them in place through `decode_store`; otherwise `read` gives copies and `update`
    keeps the new ones (`updated`) for the runner to write back."""

    def __init__(self, pool: CachePool, pages: Tensor):
        self.pool, self.pages = pool, pages
        self.state: Tensor | None = None
        self.conv: list[Tensor] | None = None
        self.updated = False

    @classmethod
    def over(cls, pool: CachePool, pages: Tensor) -> "KDAPageView":
        return cls(pool, pages)

    def read(self) -> tuple[Tensor, list[Tensor]]:
        state, conv = self.pool.read_kda(self.pages)
        return state, [conv[:, 0], conv[:, 1], conv[:, 2]]

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        self.state, self.conv, self.updated = state, list(conv), True

    def decode_store(self):
        """The pages as rows the fused decode step updates in place (k3.ops.kda_decode.KDAStore)."""
        return self.pool.kda_store(self.pages)

    def conv_stacked(self) -> Tensor:
        return torch.stack(self.conv, 1)


class KDAVerifyView:
    """One KDA layer's committed states [B, H, K, V] and conv tails [B, 3, P, W-1] for a verification forward;
    `update` drops the advanced state (it includes rejected drafts) and keeps the projected inputs of every
    verified position (`inputs`, a KDAInputs), from which k3.ops.kda_replay rebuilds the accepted prefix's state.
    No state is stored per position."""

    def __init__(self, state: Tensor, conv: Tensor):
        self.state, self.conv_tails = state, conv
        self.inputs: KDAInputs | None = None

    @classmethod
    def over(cls, pool: CachePool, pages: Tensor) -> "KDAVerifyView":
        return cls(*pool.read_kda(pages))

    def read(self) -> tuple[Tensor, list[Tensor]]:
        return self.state, [self.conv_tails[:, 0], self.conv_tails[:, 1], self.conv_tails[:, 2]]

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        if inputs is None:
            raise ValueError("a verification forward's KDA layer must hand its projected inputs to the cache")
        self.inputs = inputs


class KeptInputsView(KDAVerifyView):
    """KDA layer g's view after a static-buffer verification (k3.serve.cuda_graphs.DecodeGraphs.run_verify): no
    states (the forward did not advance them); its kept inputs are views of the step's `flat` [B, T, layers *
    width] (`inputs_of`), made when first read. A verification whose accepted positions are held (fused replay)
    keeps slices of `flat` and never reads them: 12 views per KDA layer per verification (~0.3 ms of host time at
    k3-mini's 9 KDA layers) not made."""

    def __init__(self, flat: Tensor, g: int, num_heads: int, head_dim: int):
        self.state = self.conv_tails = None
        self.flat, self.g, self.heads = flat, g, (num_heads, head_dim)

    @functools.cached_property
    def inputs(self) -> KDAInputs:
        return inputs_of(self.flat, self.g, *self.heads)

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        raise RuntimeError("a static-buffer verification's kept inputs are read from its step, not updated")


class KDAReplayVerifyView(KDAVerifyView):
    """One KDA layer's view for a verification with the replay of pending accepted positions fused in front
    (k3.serve.runner.ModelRunner with fused_replay; KimiDeltaAttention.verify_replay, k3.ops.kda_verify_step): the
    requests' pages (their committed states and conv tails, as the rows of a KDAStore), `pending` (a KDAInputs of
    [N, Pn, ...]: the positions a previous verification kept and accepted, not yet in the states) and `lengths`
    (row n's count of them, 0 for none: host ints, or an int tensor [N] on the device, what a static-buffer step
    refills before each replay). The layer's verify_replay advances each row in place to its state and conv tail
    after the pending positions (a row with nothing pending is written back unchanged; padding rows only the
    scratch page) and hands back, through `replayed`, the window's projected inputs (`inputs`, for the replay or the
    pending positions of the next cycle). The layer's plain forward (read / update) has no business with it: both
    raise."""

    def __init__(self, pool: CachePool, pages: Tensor, pending: KDAInputs, lengths: list[int] | Tensor):
        super().__init__(None, None)
        self.pool, self.pages = pool, pages
        self.pending = pending
        self.lengths = lengths if isinstance(lengths, Tensor) else list(lengths)

    def pending_replay(self):
        """What the layer's forward hands KimiDeltaAttention.verify_replay (the k3.model.cache protocol): the pending
        inputs, their counts and the pages as the rows of a k3.ops.kda_decode.KDAStore."""
        return self.pending, self.lengths, self.pool.kda_store(self.pages)

    def read(self) -> tuple[Tensor, list[Tensor]]:
        raise RuntimeError("a fused verify-replay view is run by KimiDeltaAttention.verify_replay (through "
                           "`pending_replay`), not read by the layer's plain forward")

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        raise RuntimeError("a fused verify-replay view takes its results through `replayed`, not `update`")

    def replayed(self, inputs: KDAInputs) -> None:
        """Keep verify_replay's window inputs (the rows were advanced in place)."""
        self.inputs = inputs


class KDAMixedView(KDAPageView):
    """A KDA layer's view for a forward of prefill chunks and verifications packed together
    (k3.serve.runner.ModelRunner, mixed forwards): the new states of every request of the packed forward (the runner
    writes back only the prefill requests') and the projected inputs of every position (the verifications' are kept
    for replay)."""

    def __init__(self, pool: CachePool, pages: Tensor):
        super().__init__(pool, pages)
        self.inputs: KDAInputs | None = None

    def update(self, state: Tensor, conv: list[Tensor], inputs: KDAInputs | None = None) -> None:
        if inputs is None:
            raise ValueError("a mixed forward's KDA layer must hand its projected inputs to the cache")
        super().update(state, conv)
        self.inputs = inputs

    def decode_store(self):
        return None  # a mixed forward keeps every position's inputs: never updated in place


def kept_width(num_heads: int, head_dim: int) -> int:
    """One KDA layer's kept inputs per position, side by side (`flat_inputs`): the pre-conv q, k, v, the post-conv
    q, k, v and the decay logits (H * K each), then the beta logits (H)."""
    return 7 * num_heads * head_dim + num_heads


def flat_inputs(inputs: list[KDAInputs]) -> Tensor:
    """Every KDA layer's kept inputs of one verification ([B, T, ...] each) as one tensor [B, T, layers * width]
    (layer g at columns g * width, `kept_width`'s order): what a static-buffer step outputs and a pending request
    keeps, so that each is one copy for all layers, not one per tensor and layer."""
    B, T = inputs[0].q.shape[:2]
    return torch.cat([x.reshape(B, T, -1) for i in inputs for x in (*i.pre_conv, i.q, i.k, i.v, i.z, i.beta_logits)],
                     -1)


def inputs_of(flat: Tensor, g: int, num_heads: int, head_dim: int) -> KDAInputs:
    """KDA layer g's kept inputs as views of `flat` [..., layers * width] (`flat_inputs`), nothing copied."""
    H, K = num_heads, head_dim
    C, at = H * K, g * kept_width(H, K)
    part = [flat[..., at + i * C:at + (i + 1) * C] for i in range(7)]
    beta = flat[..., at + 7 * C:at + 7 * C + H]
    return KDAInputs(tuple(part[:3]), *(x.unflatten(-1, (H, K)) for x in part[3:]), beta)


def replay_inputs_of(flat: Tensor, layers: int, num_heads: int,
                     head_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Every KDA layer's kept inputs that a replay reads, as views of `flat` [N, L, layers * width] (`flat_inputs`),
    layer first: (k, v, z [G, N, L, H, K], beta logits [G, N, L, H], pre-conv q/k/v [G, N, L, 3, H * K]); nothing
    copied (k3.model.kda.replay_layers reads them through their strides)."""
    H, K = num_heads, head_dim
    C = H * K
    x = flat.unflatten(-1, (layers, kept_width(H, K))).movedim(-2, 0)  # [G, N, L, width]
    k, v, z = (x[..., (3 + i) * C:(4 + i) * C].unflatten(-1, (H, K)) for i in (1, 2, 3))
    return k, v, z, x[..., 7 * C:7 * C + H], x[..., :3 * C].unflatten(-1, (3, C))


def append_paged(pool: CachePool, tables: Tensor, pos: Tensor, c: Tensor, k_rope: Tensor,
                 backends: Backends | None = None):
    """Write each request's T new latent rows (c [B, T, R], k_rope [B, T, Dr]; request b's first at position
    pos[b], its pages in tables[b]) and return, per query row (B * T of them, request-major), what the paged
    attention kernel reads: (the pool's MLA view, block tables [B * T, W], lengths [B * T]). Query t of request b
    sees the cache up to its own position, pos[b] + t: causal. Device ops only: nothing is read back. The write and
    the lengths are op ``mla_append`` (k3.ops.mla_append: one kernel where the registry picks it, under `backends`,
    the layer's)."""
    kv = pool.mla_view()
    lengths = mla_append_any(kv, tables, pos, c, k_rope, backends)
    if c.shape[1] == 1:
        return kv, tables, lengths
    return kv, tables.repeat_interleave(c.shape[1], dim=0), lengths


class PagedMLAView:
    """One MLA layer's paged cache for an eager forward of several requests (block tables and start positions
    on the host). Batched mode: every request adds the same number of tokens (rows of a [B, T] batch). Packed
    mode (`lengths` given): the requests' tokens of different lengths sit one after another in a single row."""

    def __init__(self, pool: CachePool, tables: list[list[int]], starts: list[int], device,
                 lengths: list[int] | None = None):
        self.pool, self.tables, self.starts, self.device = pool, tables, starts, device
        self.lengths = lengths
        self._tables_t: Tensor | None = None

    def token_positions(self, c: Tensor) -> Tensor:
        if self.lengths is not None:  # packed: each request's tokens from its own start
            return torch.cat([s + torch.arange(n, device=c.device) for s, n in zip(self.starts, self.lengths)])[None]
        T = c.shape[1]
        return torch.tensor(self.starts, device=c.device)[:, None] + torch.arange(T, device=c.device)

    def attend_gated(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor, gate: Tensor) -> Tensor:
        """`attend` with the output gate (k3.model.cache.MLALayerCache): inside the paged decode's last kernel for
        single-token steps, after the attention otherwise."""
        if self.lengths is None and q.shape[1] == 1 and attn.paged_kernel_used():
            return self._paged(attn, q, c, k_rope, gate)
        return attn.gated(gate, self.attend(attn, q, c, k_rope))

    def _paged(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor, gate: Tensor | None = None):
        # single-token steps attend straight from the pool: no gathered copy of the cache
        starts = torch.tensor(self.starts, device=self.device)
        return attn.paged(q, *append_paged(self.pool, self._table_tensor(), starts, c, k_rope,
                                           getattr(attn, "backends", None)), None, gate=gate)

    def attend(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        if self.lengths is not None:
            return torch.cat([attn.absorbed(q[:, a:b], c_i, kr_i, q_start=p_i)
                              for a, b, c_i, kr_i, p_i in self._append_packed(c, k_rope)], dim=1)
        if q.shape[1] == 1 and attn.paged_kernel_used():
            return self._paged(attn, q, c, k_rope)
        self._write(c, k_rope)
        B, T = c.shape[:2]
        if B == 1 and self.starts[0] == 0:
            return attn.expanded(q, c, k_rope)  # one request with no context yet: the prefill form
        c_all, kr_all = self._gather(max(self.starts) + T, c.dtype)
        if B == 1:
            return attn.absorbed(q, c_all, kr_all, q_start=self.starts[0])
        # host lists: checked without reading the device
        return attn.absorbed(q, c_all, kr_all, q_start=list(self.starts), kv_len=[s + T for s in self.starts])

    def _append_packed(self, c: Tensor, k_rope: Tensor):
        """Packed mode: write each request's new rows into its pages, then yield, per request, (first, end) of its
        tokens in the row, its whole context c [1, L, R] and k_rope [1, L, Dr], and its first new token's
        position."""
        pool, pt, R = self.pool, self.pool.page_tokens, c.shape[-1]
        rows = torch.cat([c, k_rope], -1)[0]  # [total, R + Dr]
        first = 0
        for table, start, n in zip(self.tables, self.starts, self.lengths):
            pos = start + torch.arange(n, device=self.device)
            tab = torch.tensor(table, device=self.device)
            pool.write_mla(tab[pos // pt], pos % pt, rows[first:first + n])
            end = start + n
            kv = pool.mla_pages(tab[: -(-end // pt)]).reshape(1, -1, rows.shape[-1])[:, :end].to(c.dtype)
            yield first, first + n, kv[..., :R], kv[..., R:], start
            first += n

    def _table_tensor(self) -> Tensor:
        """The block tables as one [B, max pages] tensor (short tables padded with page 0, never read); built once."""
        if self._tables_t is None:
            width = max(map(len, self.tables))
            self._tables_t = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], device=self.device)
        return self._tables_t

    def _write(self, c: Tensor, k_rope: Tensor) -> None:
        """Write the batch's new rows (c [B, T, R], k_rope [B, T, Dr]) at each request's positions."""
        pt = self.pool.page_tokens
        B, T, _ = c.shape
        pos = torch.tensor(self.starts, device=self.device)[:, None] + torch.arange(T, device=self.device)[None]
        page = self._table_tensor().gather(1, pos // pt)
        self.pool.write_mla(page.reshape(-1), (pos % pt).reshape(-1), torch.cat([c, k_rope], -1).reshape(B * T, -1))

    def _gather(self, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every request's cache up to position `end` as (c_all [B, end, R], k_rope_all [B, end, Dr]) in `dtype`."""
        pt, R = self.pool.page_tokens, self.pool.cfg.kv_lora_rank
        B, n_pages = len(self.tables), -(-end // pt)
        kv = self.pool.mla_pages(self._table_tensor()[:, :n_pages].reshape(-1)).reshape(B, n_pages * pt, -1)
        kv = kv[:, :end].to(dtype)
        return kv[..., :R], kv[..., R:]


class StaticMLAView:
    """One MLA layer's cache for a step over static buffers: block tables [B, max_pages] and positions [B] are
    device tensors refilled before every replay; steps of T > 1 new tokens per request run every query as its own
    row of the paged kernel."""

    def __init__(self, pool: CachePool, tables: Tensor, positions: Tensor, num_splits: int):
        self.pool, self.tables, self.positions, self.num_splits = pool, tables, positions, num_splits

    def token_positions(self, c: Tensor) -> Tensor:
        return self.positions[:, None] + torch.arange(c.shape[1], device=c.device)

    def attend(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        return self.attend_gated(attn, q, c, k_rope, None)

    def attend_gated(self, attn: LatentAttention, q: Tensor, c: Tensor, k_rope: Tensor, gate: Tensor | None) -> Tensor:
        """`attend` with the output gate applied in the paged decode's last kernel (k3.model.cache.MLALayerCache;
        None: ungated)."""
        if not attn.paged_kernel_used():
            raise RuntimeError("a static-buffer decode step needs the paged MLA decode (op mla_decode on 'triton' "
                               "under the model's Backends)")
        return attn.paged(q, *append_paged(self.pool, self.tables, self.positions, c, k_rope,
                                           getattr(attn, "backends", None)), self.num_splits, gate=gate)
