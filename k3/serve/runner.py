"""Model runner: runs prefill chunks and batched decode steps of many requests against the paged pool.

The model's layers take per-layer cache objects (k3/model/kda.py KDACache, k3/model/mla.py MLACache); the
runner builds equivalents backed by pool pages for the requests in a batch, runs the model, and writes the
new KDA states and latent KV back into the pages. Batches of single-token decode steps can instead run as one
CUDA-graph replay over static buffers (k3.serve.cuda_graphs, `ModelRunner.graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.model.batch import BatchInfo
from k3.model.cache import K3Cache
from k3.serve.cache_pool import CachePool


SCORE_ROWS = 128  # prompt positions scored per lm_head call: bounds the fp32 logits held to [SCORE_ROWS, vocab]


@dataclass
class PromptScore:
    """Score one request's new tokens first .. first + len(targets) - 1 of a forward: the logits at new token
    first + i against the id targets[i] (the token that follows it), with the top `k` alternatives."""
    first: int
    targets: list[int]
    k: int


@dataclass
class SeqSlots:
    """Where one request's cache lives: a block table per MLA layer, a running-state page per KDA layer."""
    mla_tables: list[list[int]]
    kda_pages: list[int]


class _KDAView:
    def __init__(self, state: torch.Tensor, conv: torch.Tensor):
        self.state = state
        self.conv = [conv[:, 0], conv[:, 1], conv[:, 2]]


def _append_paged(pool: CachePool, tables: torch.Tensor, pos: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor):
    """Write each request's T new latent rows (c [B, T, R], k_rope [B, T, Dr]; request b's first at position
    pos[b], its pages in tables[b]) and return, per query row (B * T of them, request-major), what the paged
    attention kernel reads: (the pool's MLA view, block tables [B * T, W], lengths [B * T]). Query t of request b
    sees the cache up to its own position, pos[b] + t: causal. Device ops only: nothing is read back."""
    pt = pool.page_tokens
    B, T = c.shape[0], c.shape[1]
    p = pos[:, None] + torch.arange(T, device=pos.device)  # [B, T] positions of the new rows
    pool.write_mla(tables.gather(1, p // pt).reshape(-1), (p % pt).reshape(-1),
                   torch.cat([c, k_rope], -1).reshape(B * T, -1))
    if T == 1:
        return pool.mla_view(), tables, pos + 1
    return pool.mla_view(), tables.repeat_interleave(T, dim=0), (p + 1).reshape(-1)


class _MLAView:
    """One MLA layer's paged cache for a batch. Batched mode: every request adds the same number of tokens
    (rows of a [B, T] batch). Packed mode (`lengths` given): the requests' tokens of different lengths sit
    one after another in a single row, and each request attends its own context."""

    num_splits = None  # split count of the paged decode kernel: None = chosen per step from the lengths

    def __init__(self, pool: CachePool, tables: list[list[int]], starts: list[int], device,
                 lengths: list[int] | None = None):
        self.pool, self.tables, self.starts, self.device = pool, tables, starts, device
        self.lengths = lengths
        self.packed = lengths is not None

    def append_packed(self, c: torch.Tensor, k_rope: torch.Tensor):
        """Packed mode: write each request's new rows into its pages, then yield, per request,
        (first, end) of its tokens in the row, its whole context c [1, L, R] and k_rope [1, L, Dr], and the
        position of its first new token."""
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

    def append_paged(self, c: torch.Tensor, k_rope: torch.Tensor):
        """Batched single-token decode: write the new rows and return the pool's typed MLA view
        [num_pages, page_tokens, R + Dr], the block tables [B, max_pages] and the lengths [B] including the new
        token, for an attention kernel that reads the pages in place (k3.ops.mla_decode)."""
        return _append_paged(self.pool, self._table_tensor(), torch.tensor(self.starts, device=self.device), c,
                             k_rope)

    def _table_tensor(self) -> torch.Tensor:
        """The block tables as one [B, max pages] tensor (short tables padded with page 0, never read)."""
        width = max(map(len, self.tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], device=self.device)

    def append(self, c: torch.Tensor, k_rope: torch.Tensor):
        pool, pt = self.pool, self.pool.page_tokens
        B, T, R = c.shape
        pos = torch.tensor(self.starts, device=self.device)[:, None] + torch.arange(T, device=self.device)[None]
        tables = self._table_tensor()
        page = tables.gather(1, pos // pt)
        pool.write_mla(page.reshape(-1), (pos % pt).reshape(-1), torch.cat([c, k_rope], -1).reshape(B * T, -1))
        ends = [s + T for s in self.starts]
        n_pages = -(-max(ends) // pt)
        kv = pool.mla_pages(tables[:, :n_pages].reshape(-1)).reshape(B, n_pages * pt, -1)[:, : max(ends)]
        kv = kv.to(c.dtype)
        c_all, kr_all = kv[..., :R], kv[..., R:]
        if B == 1:
            return c_all, kr_all, self.starts[0], None
        return c_all, kr_all, list(self.starts), ends  # host lists: checked without reading the device


class StaticMLAView:
    """One MLA layer's cache for a step over static buffers (a CUDA graph's inputs): block tables
    [B, max_pages] and positions [B] are device tensors refilled before every replay, and the paged decode
    kernel runs with a fixed split count, so the step reads nothing back from the device. Steps of T > 1 new
    tokens per request (`paged_prefill`) run every query as its own row of the paged kernel."""

    packed = False
    paged_prefill = True

    def __init__(self, pool: CachePool, tables: torch.Tensor, positions: torch.Tensor, num_splits: int):
        self.pool, self.tables, self.positions, self.num_splits = pool, tables, positions, num_splits

    def append_paged(self, c: torch.Tensor, k_rope: torch.Tensor):
        return _append_paged(self.pool, self.tables, self.positions, c, k_rope)

    def append(self, c: torch.Tensor, k_rope: torch.Tensor):
        raise RuntimeError("a static-buffer decode step needs the paged MLA decode (op mla_decode on 'triton' "
                           "under the model's Backends)")


class ModelRunner:
    def __init__(self, model, pool: CachePool):
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        layers = model.model.layers
        self.kda_layers = [i for i, l in enumerate(layers) if l.is_kda]
        self.mla_layers = [i for i, l in enumerate(layers) if not l.is_kda]
        self.graphs = None  # k3.serve.cuda_graphs.DecodeGraphs: batched single-token steps as graph replays

    def use_decode_graphs(self, max_batch: int, max_model_len: int, scratch_page: int, capture: bool = True,
                          prefill_lengths: tuple[int, ...] = ()):
        """Run batches of single-token steps (up to `max_batch` requests, contexts up to `max_model_len`), and of
        `prefill_lengths`-token chunks, over static buffers, as CUDA-graph replays (`capture`) or by calling the
        same code directly (no capture). `scratch_page`: a pool page no request ever gets; padding rows read and
        write only it."""
        from k3.serve.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_batch, max_model_len, scratch_page, capture=capture,
                                   prefill_lengths=prefill_lengths)
        return self.graphs

    @torch.no_grad()
    def forward(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
                scores: list[PromptScore | None] | None = None):
        """Run len(tokens) requests, each adding its new tokens from its own position. Requests adding the
        same number of tokens run as the rows of one batch; otherwise their tokens are packed into one row
        (KDA runs them as separate sequences with their own states, MLA attends each request's own context).
        Returns the logits of each request's last new token [B, V] (fp32). With `graphs` set, a batch of
        single-token steps runs as one step over its static buffers (a graph replay) when they can hold it.
        `scores` (one entry per request, None for most): also score those requests' new tokens from the same
        forward (`PromptScore`); the return is then (logits, [per request: None or (token logprobs [n],
        top-k logprobs [n, k], top-k ids [n, k])]), fp32 log-softmax, on the device."""
        B = len(tokens)
        if not B or any(not t for t in tokens):
            raise ValueError("every request of a forward must add at least one token")
        if scores is not None and not any(scores):
            scores = None
        if scores is not None:
            for t, sc in zip(tokens, scores):
                if sc is not None and not (0 <= sc.first and sc.first + len(sc.targets) <= len(t) and sc.targets):
                    raise ValueError(f"PromptScore(first={sc.first}, {len(sc.targets)} targets) lies outside the "
                                     f"request's {len(t)} new tokens")
        lengths = [len(t) for t in tokens]
        packed = any(n != lengths[0] for n in lengths)
        # A graph step returns only the last tokens' logits: a forward that scores tokens runs eagerly.
        if self.graphs is not None and not packed and scores is None:
            logits = self.graphs.run(tokens, starts, slots)
            if logits is not None:
                return logits
        dev = self.device
        kda_pages = torch.tensor([[s.kda_pages[g] for s in slots] for g in range(len(self.kda_layers))],
                                 device=dev, dtype=torch.long).reshape(len(self.kda_layers), B)
        mla_views = [_MLAView(self.pool, [s.mla_tables[g] for s in slots], starts, dev, lengths if packed else None)
                     for g in range(len(self.mla_layers))]
        if packed:
            ids = torch.tensor([[t for seq in tokens for t in seq]], device=dev)
            return self.run_cached(ids, kda_pages, mla_views, lengths=lengths, scores=scores)
        return self.run_cached(torch.tensor(tokens, device=dev), kda_pages, mla_views, scores=scores)

    def run_cached(self, ids: torch.Tensor, kda_pages: torch.Tensor, mla_views: list,
                   lengths: list[int] | None = None, scores: list[PromptScore | None] | None = None):
        """The model over the pool: read each KDA layer's states from pages kda_pages[g] ([n_kda, B] device
        tensor), run `ids` with per-layer caches (those KDA states, `mla_views`), write the new states back.
        ids [B, T] -> the logits of each row's last token [B, V] fp32; packed (`lengths` given: ids [1, total]
        holds the requests' tokens one after another) -> the logits of each request's last token.
        `scores`: as in `forward` (then returns (logits, scored))."""
        per_layer: list = [None] * len(self.model.model.layers)
        kda_views = []
        for g, li in enumerate(self.kda_layers):
            state, conv = self.pool.read_kda(kda_pages[g])
            view = _KDAView(state, conv)
            kda_views.append(view)
            per_layer[li] = view
        for g, li in enumerate(self.mla_layers):
            per_layer[li] = mla_views[g]
        cache = K3Cache(per_layer)
        cache.packed = lengths is not None
        if lengths is not None:
            # the packed requests' record, built on the host: their documents and each one's last token
            info = BatchInfo.from_lengths(lengths, device=ids.device, logits_at_ends=True)
            out = self.model(ids, cache=cache, batch=info, check_ids=False)
            logits, hidden = out.logits[0].float(), out.hidden_states
        else:
            out = self.model(ids, cache=cache, logits_to_keep=1, check_ids=False)
            logits, hidden = out.logits[:, -1].float(), out.hidden_states
        for g, view in enumerate(kda_views):
            self.pool.write_kda(kda_pages[g], view.state, torch.stack(view.conv, 1))
        if scores is None:
            return logits
        scored: list = []
        offset = 0
        for i, sc in enumerate(scores):
            if sc is not None:
                n = len(sc.targets)
                rows = hidden[0, offset + sc.first: offset + sc.first + n] if lengths is not None \
                    else hidden[i, sc.first: sc.first + n]
                scored.append(self._score(rows, sc.targets, sc.k))
            else:
                scored.append(None)
            if lengths is not None:
                offset += lengths[i]
        return logits, scored

    def _score(self, rows: torch.Tensor, targets: list[int], k: int):
        """Pre-norm hidden states rows [n, D] -> (logprob of targets[i] [n], top-k logprobs [n, k], their ids
        [n, k]): log-softmax in fp32, SCORE_ROWS rows at a time so at most that many rows of logits exist."""
        m = self.model
        tgt = torch.tensor(targets, device=rows.device, dtype=torch.long)
        k = min(k, m.config.vocab_size)
        lp, top_v, top_i = [], [], []
        for a in range(0, rows.shape[0], SCORE_ROWS):
            logp = torch.log_softmax(m.lm_head(m.model.norm(rows[a:a + SCORE_ROWS])).float(), -1)
            lp.append(logp.gather(1, tgt[a:a + SCORE_ROWS, None])[:, 0])
            top = torch.topk(logp, k, dim=-1)
            top_v.append(top.values)
            top_i.append(top.indices)
        return torch.cat(lp), torch.cat(top_v), torch.cat(top_i)
