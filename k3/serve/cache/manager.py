"""The cache manager: the page pool (tensors) and the prefix cache's bookkeeping (page ids) kept in step.

The scheduler owns it (k3.serve.scheduler) and calls it for every cache decision of a scheduling step: admit a
request (restore its prefix hit: copy-on-write of a partial page, a KDA checkpoint into its running state, or a
zeroed state when nothing was hit), grow a request's block tables, release a preempted or aborted request, and
finish one. After each forward the engine reports what was computed (`computed`), which registers the new hash
blocks and persists a KDA checkpoint at a hash-aligned end; `mark_landed` closes the step. The model reads the
pages through the views of k3.serve.cache.views, which the runner builds from `slots`.

Host write-back and prefetch (k3.serve.cache.host, report §5.3.1): `write_back` copies the longest restorable
cached prefix of each given token sequence (MLA rows of every MLA layer, the KDA checkpoint at its end) to host
memory; `prefetch` copies such prefixes into this pool and registers them in the prefix index. Both run between
scheduling steps (the engine holds its lock): every index entry is then landed.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from k3.config import K3Config
from k3.serve.cache.host import HostPrefix, HostPrefixStore, PrefetchReport
from k3.serve.cache.pool import CachePool
from k3.serve.cache.prefix import OutOfPages, PrefixCache, prompt_boundary
from k3.serve.cache.views import SeqSlots
from k3.serve.sequence import Sequence


class CacheManager:
    """num_mla / num_kda: the model's MLA and KDA layers (one cache group each). `memory_mb` sizes the pool;
    `scratch_page`: keep one extra page out of every request's reach (padding rows of CUDA-graph steps read and
    write only it), the pool's last."""

    def __init__(self, cfg: K3Config, num_mla: int, num_kda: int, memory_mb: float, page_tokens: int,
                 hash_block_tokens: int, enable_prefix_cache: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", scratch_page: bool = False):
        probe = CachePool(cfg, 1, page_tokens, dtype=dtype, device="meta")
        extra = int(scratch_page)
        num_pages = int(memory_mb * 2**20) // probe.page_bytes - extra
        if num_pages < num_kda + num_mla:
            raise ValueError(f"cache_memory_mb={memory_mb} holds {max(num_pages, 0)} pages of {probe.page_bytes} "
                             f"bytes; one request needs at least {num_kda + num_mla}")
        self.pool = CachePool(cfg, num_pages + extra, page_tokens, dtype=dtype, device=device)
        # The prefix index keys on MLA pages: a model without MLA layers (the all-KDA ablation) serves without it.
        enable_prefix_cache = enable_prefix_cache and num_mla > 0
        self.prefix = PrefixCache(num_pages, num_mla, num_kda, page_tokens=page_tokens,
                                  hash_block_tokens=hash_block_tokens, enable=enable_prefix_cache)
        self.scratch_page = num_pages if scratch_page else None
        self.page_tokens, self.hash_block_tokens = page_tokens, hash_block_tokens
        self.enable_prefix_cache = enable_prefix_cache
        self.host_counts: Counter = Counter()  # host write-back and prefetch: tokens, bytes, prefixes

    @property
    def num_pages(self) -> int:
        """Pages requests can get (the scratch page excluded)."""
        return self.prefix.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        """The most pages a request of `num_tokens` tokens can hold at once (a copy-on-write page included)."""
        return self.prefix.num_mla_groups * (-(-num_tokens // self.page_tokens) + 1) + self.prefix.num_kda_groups

    # --- scheduling decisions (called by the scheduler) ---------------------------------------------------------
    def admit(self, seq: Sequence) -> int | None:
        """Give a waiting request its pages and restore its prefix hit on the pool: returns the tokens hit (its
        computation starts there), or None when the pool has no room (nothing changed). A request that scores
        its prompt computes every position, so it gets no hit (its blocks are still registered as computed). A
        prompt's images are salted into its block hashes (PrefixCache.admit's `media`)."""
        try:
            adm = self.prefix.admit(seq.request_id, seq.tokens, lookup=not seq.scores_prompt, media=seq.media)
        except OutOfPages:
            return None
        for op in adm.copies:  # copy-on-write of a partial page, checkpoint -> private state
            self.pool.copy_page(op.src, op.dst, op.tokens)
        if adm.hit_tokens == 0:  # fresh pages still hold their previous owner's bytes
            self._zero_kda(adm.kda_pages)
        return adm.hit_tokens

    def grow(self, seq: Sequence, total_tokens: int) -> bool:
        """Make room for a running request's first `total_tokens` tokens (False: out of pages, nothing changed)."""
        try:
            self.prefix.ensure_capacity(seq.request_id, total_tokens)
            return True
        except OutOfPages:
            return False

    def truncate(self, seq: Sequence, total_tokens: int) -> int:
        """Shrink a running request's block tables to its first `total_tokens` tokens (after speculative
        verification, to the accepted length); returns the pages released."""
        return self.prefix.truncate(seq.request_id, total_tokens)

    def release(self, seq: Sequence) -> None:
        """Free a running request's pages without keeping what it computed past the index (preemption, abort)."""
        self.prefix.abort(seq.request_id)

    def finish(self, seq: Sequence) -> None:
        """A request is done: its pages go back, its registered blocks and checkpoints stay in the index."""
        self.prefix.finish(seq.request_id)

    # --- the engine's side of a step ----------------------------------------------------------------------------
    def slots(self, seq: Sequence) -> SeqSlots:
        tables, kda_pages = self.prefix.running_pages(seq.request_id)
        return SeqSlots(tables, kda_pages)

    def computed(self, seq: Sequence, end: int) -> None:
        """A forward over `seq` up to token `end` was launched: register its complete hash blocks, and at a
        hash-aligned end persist the KDA states there as a checkpoint (a page copy per KDA layer)."""
        if not self.enable_prefix_cache:
            return
        self.prefix.register_tokens(seq.request_id, seq.token_view(end))
        if end % self.hash_block_tokens == 0:
            # the prompt's own boundary is kept when the request moves on (as a turn boundary): the same prompt sent
            # again, or continued with a reply that was changed (reasoning dropped from the history), starts there
            keep = end == prompt_boundary(len(seq.prompt_ids), self.hash_block_tokens)
            pages = self.prefix.checkpoint_slots(seq.request_id, end, turn_boundary=keep)
            if pages:
                for src, dst in zip(self.prefix.running_pages(seq.request_id)[1], pages):
                    self.pool.copy_page(src, dst)

    def mark_landed(self) -> None:
        """The step's copies, forwards and checkpoint writes are ordered before the next step's work."""
        self.prefix.mark_landed()

    def stats(self) -> dict:
        st = dict(self.prefix.stats())
        st["pool_bytes"] = self.pool.nbytes
        st["page_bytes"] = self.pool.page_bytes
        for k in ("written_back_prefixes", "written_back_tokens", "written_back_bytes", "prefetched_prefixes",
                  "prefetched_tokens", "prefetched_bytes", "prefetch_skipped", "prefetch_skipped_tokens"):
            st[k] = self.host_counts[k]
        return st

    # --- host write-back and prefetch (k3.serve.cache.host) -----------------------------------------------------
    def signature(self) -> dict:
        """What decides whether another engine's cached bytes mean the same here (weights aside)."""
        cfg = self.pool.cfg
        conf = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) \
            else dict(vars(cfg))
        return {"model_config": conf, "page_tokens": self.page_tokens, "hash_block_tokens": self.hash_block_tokens,
                "cache_dtype": str(self.pool.dtype), "mla_groups": self.prefix.num_mla_groups,
                "kda_groups": self.prefix.num_kda_groups}

    def write_back(self, prefixes: list[list[int]]) -> HostPrefixStore:
        """Copy the longest restorable cached prefix of each token sequence to host memory (see
        PrefixCache.peek; a sequence with nothing cached is recorded with 0 tokens). Read-only on the cache: no
        reference, LRU position or counter of the index changes. Call between scheduling steps."""
        pool, pt = self.pool, self.page_tokens
        bpp = pt // self.hash_block_tokens
        dev = pool.pages.device
        store = HostPrefixStore(self.signature(), pin=dev.type == "cuda")
        for toks in prefixes:
            toks = list(toks)
            hit = self.prefix.peek(toks)
            n = len(hit.hashes)
            keys = []
            for j, pages in enumerate(hit.pages):
                key = hit.hashes[min((j + 1) * bpp, n) - 1]  # certifies every token up to the page's cached end
                if key not in store.pages:
                    rows = min(pt, hit.tokens - j * pt)
                    store.pages[key] = store.to_host(pool.mla_pages(torch.tensor(pages, device=dev))[:, :rows])
                keys.append(key)
            entry = HostPrefix(len(toks), toks[:hit.tokens], list(hit.hashes), keys)
            if hit.ckpt_pages:
                state, conv = pool.read_kda(torch.tensor(hit.ckpt_pages, device=dev))
                entry.kda_state, entry.kda_conv = store.to_host(state), store.to_host(conv)
            store.prefixes.append(entry)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the asynchronous copies into pinned memory
        self.host_counts.update(written_back_prefixes=sum(p.num_tokens > 0 for p in store.prefixes),
                                written_back_tokens=store.tokens, written_back_bytes=store.nbytes)
        return store

    def prefetch(self, store: HostPrefixStore) -> PrefetchReport:
        """Copy the store's prefixes into this pool and register them in the prefix index as landed, evictable
        entries (PrefixCache.import_prefixes): in the store's order, each whole or not at all, as long as pages can
        be found (free, or by evicting idle entries; never a running request's). Parts the index already holds are
        not copied again. Raises ValueError when the store was written by an engine of another model config,
        page_tokens, hash_block_tokens or cache dtype. Call between scheduling steps."""
        store.check_compatible(self.signature())
        pool, pt = self.pool, self.page_tokens
        dev = pool.pages.device
        report = PrefetchReport()
        todo = [i for i, p in enumerate(store.prefixes) if p.num_tokens]
        report.empty = [i for i, p in enumerate(store.prefixes) if not p.num_tokens]
        for p in store.prefixes:
            if p.num_tokens and (p.num_tokens != len(p.hashes) * self.hash_block_tokens
                                 or len(p.page_keys) != -(-p.num_tokens // pt)
                                 or (self.prefix.num_kda_groups and p.kda_state is None)):
                raise ValueError(f"a written-back prefix of {p.num_tokens} tokens is inconsistent with its "
                                 f"{len(p.hashes)} hashes, {len(p.page_keys)} pages and KDA checkpoint")
        done = self.prefix.import_prefixes([store.prefixes[i].hashes for i in todo])
        mla = pool.mla_view() if any(r is not None and r.units for r in done) else None
        for i, r in zip(todo, done):
            p = store.prefixes[i]
            if r is None:
                report.skipped.append(i)
                report.skipped_tokens += p.num_tokens
                continue
            for j, pages in r.units:
                rows = store.pages[p.page_keys[j]]
                mla[torch.tensor(pages, device=dev), :rows.shape[1]] = rows.to(dev, non_blocking=True)
                report.bytes += rows.numel() * rows.element_size()
            if r.ckpt_pages:
                pool.write_kda(torch.tensor(r.ckpt_pages, device=dev), p.kda_state.to(dev, non_blocking=True),
                               p.kda_conv.to(dev, non_blocking=True))
                report.bytes += sum(t.numel() * t.element_size() for t in (p.kda_state, p.kda_conv))
            report.fetched.append(i)
            report.tokens += r.tokens
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the host tensors may be dropped once this returns
        self.host_counts.update(prefetched_prefixes=len(report.fetched), prefetched_tokens=report.tokens,
                                prefetched_bytes=report.bytes, prefetch_skipped=len(report.skipped),
                                prefetch_skipped_tokens=report.skipped_tokens)
        return report

    def _zero_kda(self, pages: list[int]) -> None:
        if not pages:
            return
        dev = self.pool.pages.device
        n = len(pages)
        self.pool.write_kda(torch.tensor(pages, device=dev), torch.zeros(n, *self.pool.kda_state_shape, device=dev),
                            torch.zeros(n, *self.pool.kda_conv_shape, device=dev))
